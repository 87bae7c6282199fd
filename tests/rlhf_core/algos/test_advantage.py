"""GAE: the vectorised scan against the plain loop, closed forms, and mask invariance."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_core.algos.advantage import compute_gae, compute_gae_reference, discounted_reverse_cumsum
from rlhf_core.algos.registry import get_adv_estimator
from rlhf_core.algos import advantage as advantage_module

SETTINGS = settings(max_examples=40, deadline=None)
# Lengths straddling the 64-wide scan blocks and the two-level recursion.
lengths = st.one_of(st.integers(1, 70), st.sampled_from([63, 64, 65, 127, 128, 129, 200, 1000]))
unit = st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0.0, 1.0))


def _case(seed, batch, length, dtype, masks):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, length, generator=gen, dtype=torch.float64).to(dtype)
    values = torch.randn(batch, length, generator=gen, dtype=torch.float64).to(dtype)
    return gen, rewards, values, masks.make(gen, batch, length)


def _gae(fn, rewards, values, mask, gamma, lam):
    return fn(token_level_rewards=rewards, values=values, response_mask=mask, gamma=gamma, lam=lam)


def _tolerance(dtype, reference):
    scale = max(1.0, reference.abs().max().item())
    if dtype == torch.float64:
        return dict(rtol=1e-10, atol=1e-10 * scale)
    if dtype == torch.float32:
        return dict(rtol=1e-4, atol=1e-5 * scale)
    return dict(rtol=2e-2, atol=2e-2 * scale)


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 6),
    length=lengths,
    gamma=unit,
    lam=unit,
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
)
def test_vectorised_matches_loop(masks, seed, batch, length, gamma, lam, dtype):
    _, rewards, values, mask = _case(seed, batch, length, dtype, masks)
    adv, ret = _gae(compute_gae, rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = _gae(compute_gae_reference, rewards, values, mask, gamma, lam)
    assert adv.dtype == dtype and ret.dtype == dtype and adv.shape == rewards.shape
    torch.testing.assert_close(adv, ref_adv, **_tolerance(dtype, ref_adv))
    torch.testing.assert_close(ret, ref_ret, **_tolerance(dtype, ref_ret))


def _verl_loop(rewards, values, mask, gamma, lam):
    """verl's recurrence written out literally, with float masks (no zeroing at masked steps)."""
    m = mask.to(values.dtype)
    next_value, last, out = 0.0, 0.0, []
    for t in reversed(range(values.shape[-1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * last
        next_value = values[:, t] * m[:, t] + (1 - m[:, t]) * next_value
        last = candidate * m[:, t] + (1 - m[:, t]) * last
        out.append(last)
    return torch.stack(out[::-1], dim=1)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 5), length=st.integers(1, 80), gamma=unit, lam=unit)
def test_reference_is_verls_recurrence_on_valid_tokens(masks, seed, batch, length, gamma, lam):
    _, rewards, values, mask = _case(seed, batch, length, torch.float64, masks)
    adv, ret = _gae(compute_gae_reference, rewards, values, mask, gamma, lam)
    expected = _verl_loop(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv[mask], expected[mask])
    torch.testing.assert_close(ret[mask], (expected + values)[mask])


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 6), length=lengths, lam=unit)
def test_gamma_zero_gives_one_step_td(masks, seed, batch, length, lam):
    _, rewards, values, mask = _case(seed, batch, length, torch.float64, masks)
    adv, _ = _gae(compute_gae, rewards, values, mask, 0.0, lam)
    torch.testing.assert_close(adv[mask], (rewards - values)[mask])


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 6), length=lengths)
def test_gamma_lam_one_gives_monte_carlo_return_minus_value(masks, seed, batch, length):
    _, rewards, values, mask = _case(seed, batch, length, torch.float64, masks)
    adv, ret = _gae(compute_gae, rewards, values, mask, 1.0, 1.0)
    valid_rewards = torch.where(mask, rewards, torch.zeros(()))
    future_return = valid_rewards.flip(-1).cumsum(-1).flip(-1)
    torch.testing.assert_close(adv[mask], (future_return - values)[mask])
    torch.testing.assert_close(ret[mask], future_return[mask])


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 6),
    length=lengths,
    gamma=unit,
    lam=unit,
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_masked_inputs_never_reach_valid_outputs(masks, seed, batch, length, gamma, lam, dtype):
    gen, rewards, values, mask = _case(seed, batch, length, dtype, masks)
    adv, ret = _gae(compute_gae, rewards, values, mask, gamma, lam)
    junk_rewards, junk_values = masks.scramble(rewards, mask, gen), masks.scramble(values, mask, gen)
    adv2, ret2 = _gae(compute_gae, junk_rewards, junk_values, mask, gamma, lam)
    # Bitwise equal, and masked positions are exactly 0 even with inf/nan underneath.
    assert torch.equal(adv2, adv) and torch.equal(ret2, ret)
    assert not adv[~mask].any() and not ret[~mask].any()


def test_inputs_untouched_and_float_mask_accepted():
    gen = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(3, 90, generator=gen), torch.randn(3, 90, generator=gen)
    mask = (torch.rand(3, 90, generator=gen) < 0.7).float()
    copies = rewards.clone(), values.clone(), mask.clone()
    adv, _ = _gae(compute_gae, rewards, values, mask, 0.99, 0.95)
    ref, _ = _gae(compute_gae_reference, rewards, values, mask.bool(), 0.99, 0.95)
    torch.testing.assert_close(adv, ref)
    assert all(torch.equal(a, b) for a, b in zip((rewards, values, mask), copies))


@pytest.mark.parametrize("gamma, lam", [(0.99, 0.95), (1.0, 1.0), (0.5, 0.5)])
def test_long_sequences_stay_finite_and_exact(gamma, lam):
    # rho**-t for rho = 0.94 overflows float64 near t = 11_500; the blocked scan never forms it.
    gen = torch.Generator().manual_seed(1)
    rewards = torch.randn(2, 12_345, generator=gen, dtype=torch.float64)
    values = torch.randn(2, 12_345, generator=gen, dtype=torch.float64)
    mask = torch.rand(2, 12_345, generator=gen) < 0.9
    adv, _ = _gae(compute_gae, rewards, values, mask, gamma, lam)
    ref, _ = _gae(compute_gae_reference, rewards, values, mask, gamma, lam)
    assert torch.isfinite(adv).all()
    torch.testing.assert_close(adv, ref, rtol=1e-9, atol=1e-9 * max(1.0, ref.abs().max().item()))


def test_tensor_hyperparameters_and_row_chunking(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    rewards, values = torch.randn(9, 150, generator=gen), torch.randn(9, 150, generator=gen)
    mask = torch.rand(9, 150, generator=gen) < 0.8
    ref, ref_ret = _gae(compute_gae_reference, rewards, values, mask, 0.9, 0.8)
    # A tiny workspace forces several row chunks, including a ragged last one.
    monkeypatch.setattr(advantage_module, "_WORKSPACE_BYTES", 4 * 150 * 8)
    adv, ret = _gae(compute_gae, rewards, values, mask, torch.tensor(0.9), torch.tensor(0.8))
    torch.testing.assert_close(adv, ref)
    torch.testing.assert_close(ret, ref_ret)


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    length=st.one_of(st.integers(0, 140), st.sampled_from([4095, 4096, 4097])),
    rho=unit,
    block=st.sampled_from([2, 3, 16, 64]),
)
def test_discounted_reverse_cumsum_matches_naive(seed, length, rho, block):
    x = torch.randn(3, length, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    expected, running = torch.zeros_like(x), torch.zeros(3, dtype=torch.float64)
    for t in reversed(range(length)):
        running = x[:, t] + rho * running
        expected[:, t] = running
    got = discounted_reverse_cumsum(x, rho, block)
    scale = expected.abs().max().item() if length else 1.0
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9 * max(1.0, scale))


def test_registered_under_gae_and_unknown_names_list_valid_ones():
    assert get_adv_estimator("gae") is compute_gae
    with pytest.raises(ValueError, match="gae"):
        get_adv_estimator("gea")
