"""Chunked log-probs and entropy against the naive full-softmax versions (values and grads)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_core.algos.logits import entropy_from_logits, logprobs_from_logits

SETTINGS = settings(max_examples=30, deadline=None)


def _naive_entropy(logits):
    return torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)


def _naive_logprobs(logits, labels):
    return torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def _case(seed, batch, length, vocab, dtype, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, length, vocab, generator=gen, dtype=torch.float64) * scale).to(dtype)
    labels = torch.randint(0, vocab, (batch, length), generator=gen)
    upstream = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    return logits, labels, upstream


def _chunk_sizes(n):
    # Chunk boundaries: one row, awkward sizes, exactly n, more than n, and the automatic size.
    return st.sampled_from([1, 2, 3, max(1, n - 1), n, n + 1, None])


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 3),
    length=st.integers(1, 7),
    vocab=st.integers(1, 50),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    data=st.data(),
)
def test_chunked_equals_naive_values_and_gradients(seed, batch, length, vocab, dtype, data):
    chunk = data.draw(_chunk_sizes(batch * length))
    logits, labels, upstream = _case(seed, batch, length, vocab, dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)

    for ours, naive in (
        (lambda z: entropy_from_logits(z, chunk_size=chunk), _naive_entropy),
        (lambda z: logprobs_from_logits(z, labels, chunk_size=chunk), lambda z: _naive_logprobs(z, labels)),
    ):
        a = logits.clone().requires_grad_(True)
        b = logits.double().requires_grad_(True)
        got, expected = ours(a), naive(b)
        assert got.shape == (batch, length)
        torch.testing.assert_close(got.double(), expected, **tol)
        (grad_a,) = torch.autograd.grad((got.double() * upstream).sum(), a)
        (grad_b,) = torch.autograd.grad((expected * upstream).sum(), b)
        assert grad_a.dtype == dtype
        torch.testing.assert_close(grad_a.double(), grad_b, **tol)


def test_bfloat16_logits_give_float32_results_close_to_fp64():
    logits, labels, _ = _case(0, 2, 5, 300, torch.bfloat16)
    exact = logits.double()
    entropy = entropy_from_logits(logits, chunk_size=3)
    logprobs = logprobs_from_logits(logits, labels, chunk_size=4)
    assert entropy.dtype == logprobs.dtype == torch.float32
    # Computed in fp32 from the bf16 inputs, so only fp32 rounding separates them from fp64.
    torch.testing.assert_close(entropy.double(), _naive_entropy(exact), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logprobs.double(), _naive_logprobs(exact, labels), rtol=1e-5, atol=1e-5)


def test_bfloat16_gradients_match_in_dtype():
    logits, labels, upstream = _case(1, 2, 4, 64, torch.bfloat16)
    leaf = logits.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad((logprobs_from_logits(leaf, labels, chunk_size=3) * upstream.float()).sum(), leaf)
    ref_leaf = logits.double().requires_grad_(True)
    (ref,) = torch.autograd.grad((_naive_logprobs(ref_leaf, labels) * upstream).sum(), ref_leaf)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad.double(), ref, rtol=2e-2, atol=2e-2)


def test_masked_vocabulary_entries_are_handled():
    # -inf logits (top-k / vocab masking) must not produce nan: 0 * log 0 is taken as 0.
    logits = torch.tensor([[[0.0, float("-inf"), 1.0, float("-inf")]]], dtype=torch.float64, requires_grad=True)
    entropy = entropy_from_logits(logits)
    p = torch.softmax(torch.tensor([0.0, 1.0], dtype=torch.float64), -1)
    assert entropy.item() == pytest.approx(-(p * p.log()).sum().item())
    (grad,) = torch.autograd.grad(entropy.sum(), logits)
    assert torch.isfinite(grad).all() and grad[0, 0, 1] == 0
    logprob = logprobs_from_logits(logits, torch.tensor([[2]]))
    assert logprob.item() == pytest.approx(p[1].log().item())


def test_works_under_no_grad_and_on_other_leading_shapes():
    logits, labels, _ = _case(3, 2, 6, 11, torch.float32)
    with torch.no_grad():
        out = logprobs_from_logits(logits, labels, chunk_size=5)
    torch.testing.assert_close(out, _naive_logprobs(logits, labels))
    flat = entropy_from_logits(logits.reshape(12, 11), chunk_size=5)
    torch.testing.assert_close(flat, _naive_entropy(logits).reshape(12))
    with pytest.raises(ValueError, match="chunk_size"):
        entropy_from_logits(logits, chunk_size=0)


def test_autograd_gradcheck():
    logits, labels, _ = _case(4, 2, 3, 5, torch.float64)
    leaf = logits.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda z: entropy_from_logits(z, chunk_size=2), (leaf,))
    assert torch.autograd.gradcheck(lambda z: logprobs_from_logits(z, labels, chunk_size=4), (leaf,))
