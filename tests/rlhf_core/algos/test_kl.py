"""KL estimators, straight-through variants and the KL-shaped token rewards."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_core.algos.kl import apply_kl_penalty, get_kl_estimator, kl_estimator_names, kl_penalty

SETTINGS = settings(max_examples=40, deadline=None)
BASE_KINDS = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]


def _expected(kind, logprob, ref):
    d = logprob - ref
    if kind in ("kl", "k1"):
        return d
    if kind == "abs":
        return d.abs()
    if kind in ("mse", "k2"):
        return 0.5 * d * d
    log_r = (-d).clamp(-20, 20)
    return (log_r.exp() - 1 - log_r).clamp(-10, 10)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), kind=st.sampled_from(BASE_KINDS), scale=st.sampled_from([0.1, 1.0, 30.0]))
def test_estimators_have_their_formula_values(seed, kind, scale):
    gen = torch.Generator().manual_seed(seed)
    logprob = torch.randn(3, 17, generator=gen, dtype=torch.float64) * scale
    ref = torch.randn(3, 17, generator=gen, dtype=torch.float64) * scale
    torch.testing.assert_close(kl_penalty(logprob=logprob, ref_logprob=ref, kind=kind), _expected(kind, logprob, ref))


def test_k3_clamps_log_ratio_and_result():
    logprob = torch.tensor([0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    ref = torch.tensor([0.5, 5.0, 100.0, -100.0], dtype=torch.float64)
    out = kl_penalty(logprob=logprob, ref_logprob=ref, kind="k3")
    assert torch.isfinite(out).all()
    assert out[0] == pytest.approx(math.exp(0.5) - 1.5)
    # exp(5) - 6, exp(20) - 21 and exp(-20) + 19 all exceed the +10 cap.
    assert out[1:].tolist() == [10.0, 10.0, 10.0]
    # Without the +-20 clamp on the log-ratio, exp(1000) is inf in float32 and the backward
    # through the capped result computes 0 * inf = nan.
    logprob32 = torch.tensor([0.0, -1000.0], requires_grad=True)
    ref32 = torch.tensor([1000.0, 0.0])
    out32 = kl_penalty(logprob=logprob32, ref_logprob=ref32, kind="k3")
    assert out32.tolist() == [10.0, 10.0]
    (grad,) = torch.autograd.grad(out32.sum(), logprob32)
    assert torch.isfinite(grad).all()


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), kind=st.sampled_from(BASE_KINDS))
def test_straight_through_has_named_value_and_k2_gradient(seed, kind):
    gen = torch.Generator().manual_seed(seed)
    logprob = (torch.randn(4, 9, generator=gen, dtype=torch.float64) - 1).requires_grad_(True)
    ref = (torch.randn(4, 9, generator=gen, dtype=torch.float64) - 1).requires_grad_(True)
    weights = torch.randn(4, 9, generator=gen, dtype=torch.float64)

    plus = kl_penalty(logprob=logprob, ref_logprob=ref, kind=kind + "+")
    base = kl_penalty(logprob=logprob, ref_logprob=ref, kind=kind)
    k2 = kl_penalty(logprob=logprob, ref_logprob=ref, kind="k2")
    torch.testing.assert_close(plus, base)
    grads_plus = torch.autograd.grad((plus * weights).sum(), (logprob, ref))
    grads_k2 = torch.autograd.grad((k2 * weights).sum(), (logprob, ref))
    for got, expected in zip(grads_plus, grads_k2):
        torch.testing.assert_close(got, expected)
    # k2's gradient w.r.t. logprob is the log-ratio itself.
    torch.testing.assert_close(grads_plus[0], weights * (logprob - ref).detach())


def test_unknown_kind_lists_valid_ones():
    with pytest.raises(ValueError) as info:
        kl_penalty(logprob=torch.zeros(1), ref_logprob=torch.zeros(1), kind="k4")
    for name in ("k1", "k3", "k3+", "low_var_kl", "abs+"):
        assert name in str(info.value)
    with pytest.raises(ValueError):
        get_kl_estimator("k3++")
    assert set(BASE_KINDS) | {k + "+" for k in BASE_KINDS} == set(kl_estimator_names())


def _penalty(scores, old, ref, mask, coef, kind):
    return apply_kl_penalty(
        scores=scores, old_log_prob=old, ref_log_prob=ref, response_mask=mask, kl_coef=coef, kind=kind
    )


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 6),
    length=st.integers(1, 30),
    coef=st.floats(0.0, 2.0),
    kind=st.sampled_from(["k1", "k3", "abs", "k3+"]),
)
def test_apply_kl_penalty_places_score_and_penalises_valid_tokens(masks, seed, batch, length, coef, kind):
    gen = torch.Generator().manual_seed(seed)
    mask = masks.make(gen, batch, length)
    old = torch.randn(batch, length, generator=gen, dtype=torch.float64) - 2
    ref = torch.randn(batch, length, generator=gen, dtype=torch.float64) - 2
    scores = torch.randn(batch, generator=gen, dtype=torch.float64)
    rewards, metrics = _penalty(scores, old, ref, mask, coef, kind)

    kl = _expected(kind.rstrip("+"), old, ref)
    expected = torch.where(mask, -coef * kl, torch.zeros(()))
    row_kls = []
    for i in range(batch):
        valid_idx = mask[i].nonzero().flatten()
        # verl's reward manager: the score at index (valid length - 1), -1 for an empty row
        expected[i, valid_idx[-1] if valid_idx.numel() else -1] += scores[i]
        row_kls.append(kl[i][mask[i]].mean() if valid_idx.numel() else torch.tensor(0.0, dtype=torch.float64))
    torch.testing.assert_close(rewards, expected)
    torch.testing.assert_close(metrics["kl/mean"], torch.stack(row_kls).mean())  # verl: an empty row counts as 0
    assert metrics["kl/mean"].dim() == 0 and metrics["kl/coef"].dim() == 0
    assert metrics["kl/coef"].item() == pytest.approx(coef)

    junk_old, junk_ref = masks.scramble(old, mask, gen), masks.scramble(ref, mask, gen)
    rewards2, metrics2 = _penalty(scores, junk_old, junk_ref, mask, coef, kind)
    assert torch.equal(rewards2, rewards) and torch.equal(metrics2["kl/mean"], metrics["kl/mean"])


def test_score_lands_on_last_valid_token_with_gaps_and_padding():
    mask = torch.tensor([[0, 1, 1, 0, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    zeros = torch.zeros(3, 7)
    rewards, metrics = _penalty(torch.tensor([2.0, 3.0, 4.0]), zeros, zeros, mask, 0.1, "k1")
    expected = torch.zeros(3, 7)
    expected[0, 4], expected[1, 6] = 2.0, 3.0
    expected[2, 6] = 4.0  # the all-masked row's score sits in the last column, where verl writes it
    assert torch.equal(rewards, expected)
    assert metrics["kl/mean"] == 0
