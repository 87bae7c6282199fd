"""Memory-aware log-probs and entropy from LM logits.

A (B, T, V) logits tensor with V ~ 150k is already the largest activation in training; a
full ``log_softmax`` or ``softmax`` of it doubles that, and autograd would keep the copy for
backward. Both functions here walk the flattened tokens in chunks and are custom autograd
functions that save only the logits (which autograd holds anyway) plus O(N) statistics, and
recompute each chunk's softmax in backward. Peak extra memory is a few chunks, not a copy.

Temperature: callers divide the logits by the sampling temperature *before* calling; these
functions never rescale, so there is exactly one place where temperature is applied.

Results are computed and returned in at least float32 (bf16 log-probs would carry ~3
significant digits into the PPO ratio); gradients are returned in the logits' dtype.
"""

from __future__ import annotations

from typing import Optional

import torch

# Auto chunk: about 2**25 elements (128 MiB in fp32) of logits per step.
_CHUNK_ELEMENTS = 1 << 25


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rows_per_chunk(chunk_size: Optional[int], vocab: int) -> int:
    if chunk_size is None:
        return max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return chunk_size


class _LogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, rows: int) -> torch.Tensor:
        acc = _acc_dtype(logits.dtype)
        out = torch.empty(logits.shape[0], dtype=acc, device=logits.device)
        lse = torch.empty_like(out)
        for start in range(0, logits.shape[0], rows):
            z = logits[start : start + rows].to(acc)
            lse[start : start + rows] = torch.logsumexp(z, dim=-1)
            picked = z.gather(1, labels[start : start + rows].unsqueeze(1)).squeeze(1)
            out[start : start + rows] = picked - lse[start : start + rows]
        ctx.save_for_backward(logits, labels, lse)
        ctx.rows = rows
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        logits, labels, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.rows):
            stop = start + ctx.rows
            g = grad_out[start:stop].unsqueeze(1).to(lse.dtype)
            # d(z_y - lse)/dz = onehot(y) - softmax(z)
            chunk = -torch.exp(logits[start:stop].to(lse.dtype) - lse[start:stop].unsqueeze(1)) * g
            chunk = chunk.scatter_add(1, labels[start:stop].unsqueeze(1), g)
            grad[start:stop] = chunk.to(grad.dtype)
        return grad, None, None


class _Entropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, rows: int) -> torch.Tensor:
        acc = _acc_dtype(logits.dtype)
        entropy = torch.empty(logits.shape[0], dtype=acc, device=logits.device)
        lse = torch.empty_like(entropy)
        for start in range(0, logits.shape[0], rows):
            z = logits[start : start + rows].to(acc)
            chunk_lse = torch.logsumexp(z, dim=-1, keepdim=True)
            p = torch.exp(z - chunk_lse)
            lse[start : start + rows] = chunk_lse.squeeze(1)
            entropy[start : start + rows] = chunk_lse.squeeze(1) - _p_times_z(p, z).sum(dim=-1)
        ctx.save_for_backward(logits, lse, entropy)
        ctx.rows = rows
        return entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        logits, lse, entropy = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.rows):
            stop = start + ctx.rows
            z = logits[start:stop].to(lse.dtype)
            p = torch.exp(z - lse[start:stop].unsqueeze(1))
            # dH/dz_j = p_j * (E_p[z] - z_j), with E_p[z] = lse - H.
            expected_z = (lse[start:stop] - entropy[start:stop]).unsqueeze(1)
            chunk = _p_times_z(p, expected_z - z) * grad_out[start:stop].unsqueeze(1).to(lse.dtype)
            grad[start:stop] = chunk.to(grad.dtype)
        return grad, None


def _p_times_z(p: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    # A -inf logit (vocab masking) has p = 0; define 0 * inf = 0 as the limit p log p -> 0 does.
    return torch.where(p > 0, p * z, torch.zeros((), dtype=p.dtype, device=p.device))


def logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, chunk_size: Optional[int] = None
) -> torch.Tensor:
    """``log softmax(logits)[label] = logits[label] - logsumexp(logits)``, chunked.

    Args: ``logits`` (..., V) (already divided by temperature); ``labels`` (...) integer ids
    in [0, V). ``chunk_size``: tokens per chunk (default: ~2**25 / V).
    Returns (...) log-probs (float32, or float64 for float64 logits); differentiable.
    """
    vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab)
    flat_labels = labels.reshape(-1).long()
    out = _LogProbs.apply(flat_logits, flat_labels, _rows_per_chunk(chunk_size, vocab))
    return out.view(labels.shape)


def entropy_from_logits(logits: torch.Tensor, chunk_size: Optional[int] = None) -> torch.Tensor:
    """Entropy of ``softmax(logits)``: ``H = logsumexp(z) - sum_j softmax(z)_j * z_j``, chunked.

    Args: ``logits`` (..., V), e.g. (B, T, V); ``chunk_size`` as in ``logprobs_from_logits``.
    Returns (...), e.g. (B, T) (float32, or float64 for float64 logits); differentiable, so it
    can enter the actor loss with an entropy coefficient.
    """
    vocab = logits.shape[-1]
    out = _Entropy.apply(logits.reshape(-1, vocab), _rows_per_chunk(chunk_size, vocab))
    return out.view(logits.shape[:-1])
