"""Masked statistics, whitening and loss aggregation (incl. micro-batch / global-count shares), and
the aggregation against a transcription of verl's ``agg_loss`` and of how verl's trainers scale it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_core.algos.registry import AGG_MODES, get_agg_fn
from rlhf_core.algos.aggregation import agg_loss, global_counts, masked_mean, masked_var, masked_whiten

SETTINGS = settings(max_examples=40, deadline=None)
MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def _case(seed, batch, length, masks, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(batch, length, generator=gen, dtype=torch.float64) * 3 + 1).to(dtype)
    return gen, x, masks.make(gen, batch, length)


def _naive_agg(loss, mask, mode, scale=None):
    """Straight from the definitions, row by row in Python."""
    rows = [loss[i][mask[i]] for i in range(loss.shape[0])]
    alive = [r for r in rows if r.numel() > 0]
    flat = torch.cat(rows)
    if mode == "token-mean":
        return flat.mean() if flat.numel() else torch.tensor(0.0, dtype=loss.dtype)
    if mode == "token-sum":
        return flat.sum()
    if not alive:
        return torch.tensor(0.0, dtype=loss.dtype)
    if mode == "seq-mean-token-mean":
        return torch.stack([r.mean() for r in alive]).mean()
    seq_mean_token_sum = torch.stack([r.sum() for r in alive]).mean()
    if mode == "seq-mean-token-sum":
        return seq_mean_token_sum
    return seq_mean_token_sum / (loss.shape[-1] if scale is None else scale)  # Dr. GRPO: over a constant


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 6), length=st.integers(1, 40))
def test_masked_mean_and_var_match_selection(masks, seed, batch, length):
    _, x, mask = _case(seed, batch, length, masks)
    selected = x[mask]
    if selected.numel() >= 2:
        torch.testing.assert_close(masked_var(x, mask), selected.var(unbiased=True))
        torch.testing.assert_close(masked_var(x, mask, unbiased=False), selected.var(unbiased=False))
    expected_mean = selected.mean() if selected.numel() else torch.tensor(0.0, dtype=x.dtype)
    torch.testing.assert_close(masked_mean(x, mask), expected_mean)
    zero = torch.tensor(0.0, dtype=x.dtype)
    row_means = torch.stack([x[i][mask[i]].mean() if mask[i].any() else zero for i in range(batch)])
    torch.testing.assert_close(masked_mean(x, mask, dim=-1), row_means)


def test_variance_of_fewer_than_two_tokens_is_zero_not_an_error():
    x = torch.tensor([[5.0, 7.0]])
    assert masked_var(x, torch.tensor([[True, False]])) == 0
    assert masked_var(x, torch.tensor([[False, False]])) == 0


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 6),
    length=st.integers(2, 40),
    shift_mean=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_whiten_normalises_valid_tokens_and_ignores_masked(masks, seed, batch, length, shift_mean, dtype):
    gen, x, mask = _case(seed, batch, length, masks, dtype)
    out = masked_whiten(x, mask, shift_mean=shift_mean)
    assert out.dtype == dtype and not out[~mask].any()
    selected = x[mask].double()
    if selected.numel() >= 3 and selected.std() > 1e-3:
        expected = (selected - selected.mean()) / torch.sqrt(selected.var() + 1e-8)
        if not shift_mean:
            expected = expected + selected.mean()
        torch.testing.assert_close(out[mask].double(), expected, rtol=1e-4, atol=1e-4)
    junk = masks.scramble(x, mask, gen)
    assert torch.equal(masked_whiten(junk, mask, shift_mean=shift_mean), out)


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 8),
    length=st.integers(1, 30),
    mode=st.sampled_from(MODES),
    scale=st.one_of(st.none(), st.floats(0.5, 100.0)),
)
def test_agg_modes_match_their_definitions_and_ignore_masked_values(masks, seed, batch, length, mode, scale):
    gen, loss, mask = _case(seed, batch, length, masks)
    got = agg_loss(loss_mat=loss, loss_mask=mask, loss_agg_mode=mode, loss_scale_factor=scale)
    torch.testing.assert_close(got, _naive_agg(loss, mask, mode, scale))
    junk = agg_loss(loss_mat=masks.scramble(loss, mask, gen), loss_mask=mask, loss_agg_mode=mode, loss_scale_factor=scale)
    assert torch.equal(junk, got)


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 12),
    length=st.integers(1, 30),
    mode=st.sampled_from(MODES),
    n_parts=st.integers(1, 5),
)
def test_micro_batch_shares_sum_to_full_batch(masks, seed, batch, length, mode, n_parts):
    gen, loss, mask = _case(seed, batch, length, masks)
    loss = loss.requires_grad_(True)
    num_tokens, num_seqs = global_counts(mask)
    full = agg_loss(loss_mat=loss, loss_mask=mask, loss_agg_mode=mode, global_num_tokens=num_tokens,
                    global_num_seqs=num_seqs)
    (full_grad,) = torch.autograd.grad(full, loss)

    # Random contiguous split of a shuffled batch, as a sampler + micro-batcher would do.
    order = torch.randperm(batch, generator=gen)
    cuts = sorted(torch.randint(0, batch + 1, (n_parts - 1,), generator=gen).tolist())
    parts = [order[a:b] for a, b in zip([0] + cuts, cuts + [batch])]
    total = sum(
        agg_loss(
            loss_mat=loss[idx],
            loss_mask=mask[idx],
            loss_agg_mode=mode,
            global_num_tokens=num_tokens,
            global_num_seqs=num_seqs,
        )
        for idx in parts
    )
    (split_grad,) = torch.autograd.grad(total, loss)
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(split_grad, full_grad)


def test_all_masked_batch_aggregates_to_zero():
    loss = torch.full((3, 4), float("nan"))
    mask = torch.zeros(3, 4, dtype=torch.bool)
    for mode in MODES:
        assert agg_loss(loss_mat=loss, loss_mask=mask, loss_agg_mode=mode) == 0


def test_unknown_mode_lists_valid_modes():
    assert sorted(AGG_MODES.names()) == sorted(MODES)
    with pytest.raises(ValueError) as info:
        agg_loss(loss_mat=torch.zeros(1, 1), loss_mask=torch.ones(1, 1), loss_agg_mode="token_mean")
    assert all(mode in str(info.value) for mode in MODES)
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        get_agg_fn("mean")


# ---------------------------------------------------------------------------------------------
# against verl (verl/trainer/ppo/core_algos.py agg_loss; verl/workers/actor/dp_actor.py)
# ---------------------------------------------------------------------------------------------


def _verl_agg(loss, mask, mode, dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None):
    """verl 0.9.1's agg_loss, written out from its formulas (float mask, sums of loss * mask, 1e-8
    guard). A fast unit test; tests/conformance compares against verl itself."""
    m = mask.to(loss.dtype)
    if mode == "token-mean":
        n = m.sum() if batch_num_tokens is None else batch_num_tokens
        return (loss * m).sum() / n * dp_size
    if mode == "token-sum":
        return (loss * m).sum() * dp_size
    counts = m.sum(-1)
    per_row = (loss * m).sum(-1) if mode != "seq-mean-token-mean" else (loss * m).sum(-1) / (counts + 1e-8)
    alive = (counts > 0).to(loss.dtype)
    b = alive.sum() if global_batch_size is None else global_batch_size
    value = (per_row * alive).sum() / b * dp_size
    if mode == "seq-mean-token-sum-norm":
        value = value / (mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return value


def _gapped_case(masks, seed, batch, length):
    """float64 losses with gapped/random masks and at least one counted token in every row (verl's
    token-mean is 0/0 on an all-masked batch; its seq modes then divide by a nominal batch size)."""
    gen, loss, mask = _case(seed, batch, length, masks)
    mask[:, 0] |= ~mask.any(-1)
    return gen, loss.requires_grad_(True), mask


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 8), length=st.integers(1, 30),
       mode=st.sampled_from(MODES), scale=st.one_of(st.none(), st.floats(0.5, 600.0)))
def test_agg_loss_is_verls_on_a_whole_mini_batch(masks, seed, batch, length, mode, scale):
    _, loss, mask = _gapped_case(masks, seed, batch, length)
    ours = agg_loss(loss_mat=loss, loss_mask=mask, loss_agg_mode=mode, loss_scale_factor=scale)
    verl = _verl_agg(loss, mask, mode, loss_scale_factor=scale)
    (g_ours,), (g_verl,) = torch.autograd.grad(ours, loss), torch.autograd.grad(verl, loss)
    torch.testing.assert_close(ours, verl, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g_ours, g_verl, rtol=1e-6, atol=1e-6)


def _split(gen, batch, dp, parts):
    """Rank → its micro-batches (index tensors): a shuffled mini-batch dealt to dp ranks, each cut
    into up to ``parts`` contiguous micro-batches (some ranks may hold none)."""
    order = torch.randperm(batch, generator=gen)
    out = []
    for r in range(dp):
        share = order[r::dp]
        cuts = sorted(torch.randint(0, len(share) + 1, (parts - 1,), generator=gen).tolist())
        out.append([share[a:b] for a, b in zip([0] + cuts, cuts + [len(share)]) if b > a])
    return out


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 12), length=st.integers(1, 30),
       mode=st.sampled_from(MODES), dp=st.integers(1, 3), parts=st.integers(1, 4))
def test_micro_batch_shares_give_verls_mini_batch_gradient_on_any_split(masks, seed, batch, length, mode, dp,
                                                                         parts):
    """The trainer's recipe (shares with global counts, gradients summed over micro-batches, loss
    × dp_size, averaged over ranks as DDP/DeepSpeed do) gives the loss and gradient of verl's
    agg_loss over the whole mini-batch, for every mode and any cut into ranks and micro-batches.
    verl's engine (global batch_num_tokens / global_batch_size, dp_size in the loss) gives the same numbers."""
    gen, loss, mask = _gapped_case(masks, seed, batch, length)
    c = float(length + 3)
    n_tok, n_seq = global_counts(mask)
    shares = [agg_loss(loss_mat=loss[i], loss_mask=mask[i], loss_agg_mode=mode, global_num_tokens=n_tok,
                       global_num_seqs=n_seq, loss_scale_factor=c) * dp
              for rank in _split(gen, batch, dp, parts) for i in rank]
    ours = torch.stack(shares).sum() / dp
    full = _verl_agg(loss, mask, mode, loss_scale_factor=c)
    (g_ours,), (g_full,) = torch.autograd.grad(ours, loss), torch.autograd.grad(full, loss)
    torch.testing.assert_close(ours, full, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g_ours, g_full, rtol=1e-6, atol=1e-6)
    engine = sum(_verl_agg(loss[i], mask[i], mode, dp_size=dp, batch_num_tokens=n_tok, global_batch_size=batch,
                           loss_scale_factor=c) for rank in _split(gen, batch, dp, parts) for i in rank) / dp
    torch.testing.assert_close(engine, full, rtol=1e-6, atol=1e-6)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(2, 12), length=st.integers(2, 30),
       mode=st.sampled_from(["seq-mean-token-sum", "seq-mean-token-mean"]), parts=st.integers(1, 4))
def test_verls_micro_batch_share_weighting_agrees_for_the_seq_mean_modes(masks, seed, batch, length, mode, parts):
    """verl's default actor (dp_actor) aggregates each micro-batch alone and scales it by its share of
    the mini-batch's sequences (micro size / mini size). For the seq-mean modes that is exactly the
    whole mini-batch's value, i.e. ours; for token-mean and seq-mean-token-sum-norm it is not (it
    depends on the cut), which is why the update uses global counts instead."""
    gen, loss, mask = _gapped_case(masks, seed, batch, length)
    (micro,) = _split(gen, batch, 1, parts)
    legacy = sum(_verl_agg(loss[i], mask[i], mode) * (len(i) / batch) for i in micro)
    torch.testing.assert_close(legacy, agg_loss(loss_mat=loss, loss_mask=mask, loss_agg_mode=mode),
                               rtol=1e-6, atol=1e-6)
