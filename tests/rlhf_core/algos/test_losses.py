"""PPO clipped policy loss (with dual clip) and clipped value loss."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_core.algos.registry import POLICY_LOSSES, get_policy_loss_fn, register_policy_loss
from rlhf_core.algos.losses import compute_policy_loss, compute_value_loss
from rlhf_core.algos.aggregation import global_counts

SETTINGS = settings(max_examples=40, deadline=None)
MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def _policy(old, new, adv, mask, **kw):
    return compute_policy_loss(old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask, **kw)


def _value(vpreds, values, returns, mask, **kw):
    return compute_value_loss(vpreds=vpreds, values=values, returns=returns, response_mask=mask, **kw)


def _batch(seed, batch, length, masks):
    gen = torch.Generator().manual_seed(seed)
    mask = masks.make(gen, batch, length)
    old = torch.randn(batch, length, generator=gen, dtype=torch.float64) - 2
    new = old + 0.3 * torch.randn(batch, length, generator=gen, dtype=torch.float64)
    adv = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    return gen, mask, old, new, adv


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 6), length=st.integers(1, 30))
def test_on_policy_loss_is_minus_mean_advantage_with_nothing_clipped(masks, seed, batch, length):
    _, mask, old, _, adv = _batch(seed, batch, length, masks)
    new = old.clone().requires_grad_(True)
    loss, metrics = _policy(old, new, adv, mask)
    n = mask.sum().clamp(min=1)
    torch.testing.assert_close(loss, -(adv * mask).sum() / n)
    assert metrics["pg_clipfrac"] == 0 and metrics["pg_clipfrac_lower"] == 0 and metrics["ppo_kl"] == 0
    # The on-policy gradient is the REINFORCE one: -A / N on valid tokens.
    (grad,) = torch.autograd.grad(loss, new)
    torch.testing.assert_close(grad, torch.where(mask, -adv / n, torch.zeros(())))


@SETTINGS
@given(
    old=st.floats(-30, 0),
    delta=st.floats(-30, 30),
    adv=st.floats(-10, 10),
    c=st.floats(1.01, 10),
    low=st.floats(0.0, 0.5),
    high=st.floats(0.0, 0.5),
)
def test_per_token_loss_bounds(old, delta, adv, c, low, high):
    t = lambda v: torch.tensor([[v]], dtype=torch.float64)  # noqa: E731
    loss, _ = _policy(t(old), t(old + delta), t(adv), t(1.0), clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c)
    if adv < 0:
        assert loss.item() <= c * abs(adv) * (1 + 1e-12)  # dual clip
    ratio = torch.exp((t(old + delta) - t(old)).clamp(-20, 20)).item()
    clipped = min(max(ratio, 1 - low), 1 + high)
    # PPO is pessimistic: never below either surrogate, unless the dual clip caps it.
    pessimistic = max(-adv * ratio, -adv * clipped)
    expected = min(pessimistic, -adv * c) if adv < 0 else pessimistic
    assert loss.item() == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_clipfracs_match_a_hand_count():
    ratio = torch.tensor([[1.5, 0.5, 1.0, 0.5, 5.0, 1.1, 9.0, 0.1]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0, 1.0, 1.0, -2.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 1]], dtype=torch.bool)
    # token: 0 clipped (1.5 > 1.2, A > 0); 1 not (0.5 < 1 with A > 0 keeps the unclipped loss);
    # 2 not (ratio 1); 3 clipped (0.5 < 0.8, A < 0); 4: L1 = 5 > L2 = 1.2 so not clipped, but the
    # dual clip caps 5 at c = 3; 5 within range; 6 masked; 7 clipped (0.1 < 0.8, A < 0).
    loss, metrics = _policy(torch.zeros_like(ratio), ratio.log(), adv, mask)
    assert metrics["pg_clipfrac"].item() == pytest.approx(3 / 7)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(1 / 7)
    per_token = [-1.2, -0.5, 1.0, 0.8, 3.0, -1.1, 0.0, 1.6]
    assert loss.item() == pytest.approx(sum(per_token) / 7)
    assert metrics["ppo_kl"].item() == pytest.approx(-(ratio.log() * mask).sum().item() / 7)


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 6),
    length=st.integers(1, 30),
    mode=st.sampled_from(MODES),
)
def test_masked_positions_change_neither_loss_nor_gradient(masks, seed, batch, length, mode):
    gen, mask, old, new, adv = _batch(seed, batch, length, masks)
    new = new.requires_grad_(True)
    loss, metrics = _policy(old, new, adv, mask, loss_agg_mode=mode)
    (grad,) = torch.autograd.grad(loss, new)
    junk = lambda x: masks.scramble(x.detach(), mask, gen)  # noqa: E731
    junk_new = junk(new).requires_grad_(True)
    loss2, metrics2 = _policy(junk(old), junk_new, junk(adv), mask, loss_agg_mode=mode)
    (grad2,) = torch.autograd.grad(loss2, junk_new)
    assert torch.equal(loss2, loss) and torch.equal(grad2, grad)
    assert not grad2[~mask].any()
    assert all(torch.equal(metrics2[k], metrics[k]) for k in metrics)

    vpreds = adv.clone().requires_grad_(True)
    vloss, _ = _value(vpreds, old, new.detach(), mask, loss_agg_mode=mode)
    (vgrad,) = torch.autograd.grad(vloss, vpreds)
    junk_vpreds = junk(adv).requires_grad_(True)
    vloss2, _ = _value(junk_vpreds, junk(old), junk(new), mask, loss_agg_mode=mode)
    (vgrad2,) = torch.autograd.grad(vloss2, junk_vpreds)
    assert torch.equal(vloss2, vloss) and torch.equal(vgrad2, vgrad)


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(2, 10),
    length=st.integers(1, 20),
    mode=st.sampled_from(MODES),
)
def test_micro_batches_with_global_counts_sum_to_full_batch_losses(masks, seed, batch, length, mode):
    _, mask, old, new, adv = _batch(seed, batch, length, masks)
    num_tokens, num_seqs = global_counts(mask)
    shares = dict(loss_agg_mode=mode, global_num_tokens=num_tokens, global_num_seqs=num_seqs)
    full_pg, _ = _policy(old, new, adv, mask, **shares)
    full_vf, _ = _value(adv, old, new, mask, **shares)
    cut = batch // 2
    split_pg = sum(_policy(old[s], new[s], adv[s], mask[s], **shares)[0] for s in (slice(0, cut), slice(cut, None)))
    split_vf = sum(_value(adv[s], old[s], new[s], mask[s], **shares)[0] for s in (slice(0, cut), slice(cut, None)))
    torch.testing.assert_close(split_pg, full_pg)
    torch.testing.assert_close(split_vf, full_vf)


def test_dual_clip_constant_must_exceed_one():
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        _policy(x, x, x, torch.ones(1, 1), clip_ratio_c=1.0)


def test_value_loss_clipping_on_constructed_cases():
    old_values = torch.zeros(1, 4, dtype=torch.float64)
    # token 0: v moved 1.0 away from v_old toward R = 2 -> the clipped prediction 0.5 is further
    #          from R, so the clipped (larger) term counts: (0.5 - 2)^2 = 2.25;
    # token 1: v inside the +-0.5 band -> both terms equal, not counted as clipped: (0.2 - 2)^2;
    # token 2: v moved away from R = 0 -> unclipped is larger: 3^2 = 9;
    # token 3: masked.
    vpreds = torch.tensor([[1.0, 0.2, 3.0, 100.0]], dtype=torch.float64)
    returns = torch.tensor([[2.0, 2.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    loss, metrics = _value(vpreds, old_values, returns, mask, cliprange_value=0.5)
    assert loss.item() == pytest.approx(0.5 * (2.25 + 1.8**2 + 9.0) / 3)
    assert metrics["vf_clipfrac"].item() == pytest.approx(1 / 3)
    wide, wide_metrics = _value(vpreds, old_values, returns, mask, cliprange_value=10.0)
    assert wide.item() == pytest.approx(0.5 * (1.0 + 1.8**2 + 9.0) / 3)
    assert wide_metrics["vf_clipfrac"] == 0


def test_policy_loss_registry_plugs_in_by_name():
    assert get_policy_loss_fn("vanilla") is compute_policy_loss

    @register_policy_loss("test_only_reinforce")
    def reinforce(*, old_log_prob, log_prob, advantages, response_mask, **_):
        return -(log_prob * advantages)[response_mask].mean(), {}

    try:
        assert get_policy_loss_fn("test_only_reinforce") is reinforce
        with pytest.raises(ValueError, match="already registered"):
            register_policy_loss("vanilla")(reinforce)
        with pytest.raises(ValueError) as info:
            get_policy_loss_fn("vanila")
        assert "vanilla" in str(info.value) and "test_only_reinforce" in str(info.value)
    finally:
        POLICY_LOSSES.unregister("test_only_reinforce")
