"""Masked statistics and loss aggregation.

Conventions used throughout ``rlhf_core.algos``: tensors are (B, T) = (rows, response tokens);
a mask is 1 (any non-zero) for a counted token and 0 otherwise. Masked positions may hold any
value, even NaN/inf: every reduction here selects with ``torch.where`` instead of multiplying
by the mask, so garbage at padding can never leak into a result (``nan * 0`` is ``nan``).

Micro-batch / data-parallel convention (the one place it is written down)
-------------------------------------------------------------------------
``agg_loss`` (and the losses that call it) take optional *global* counts for one optimizer step
(a PPO mini-batch):

* ``global_num_tokens``: valid tokens in the whole mini-batch, summed over all micro-batches
  and all data-parallel ranks;
* ``global_num_seqs``: rows of the mini-batch, likewise summed (verl's ``global_batch_size``: a
  fully masked row counts in the denominator and adds 0 to the sum).

Given them, each call returns its *share*: ``local_sum / global_count``. Summing the returned
values over every micro-batch and every rank therefore yields exactly the full-batch loss, for
every mode (``token-sum`` needs no count, and ``seq-mean-token-sum-norm`` only divides by a constant more). The
trainer must then *sum* gradients over micro-batches (plain accumulation, no ``1/grad_accum``
scaling) and, because DDP/FSDP/DeepSpeed *average* gradients over ranks, multiply the loss by
``dp_size`` before ``backward``. (verl's newer engine folds that ``dp_size`` factor into
``agg_loss``; we keep parallelism out of this module so it stays a pure function of its inputs.)
Without global counts the result is the plain local value, as if the micro-batch were the batch.

How this relates to verl's ``agg_loss`` (verl/trainer/ppo/core_algos.py, 0.9.1): verl's trainer
passes the same global counts (``batch_num_tokens``, ``global_batch_size``) and returns
``local_sum / global_count * dp_size``; we leave the ``dp_size`` factor to the trainer. Per micro-batch
and summed, every mode equals verl's (the conformance step, ``tests/conformance``, checks it against
verl itself).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from .registry import AGG_MODES, register_agg_mode

Count = Union[int, float, torch.Tensor]


def _valid(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def _upcast(values: torch.Tensor) -> torch.Tensor:
    # bf16 cannot even represent most token counts above 256 exactly; reduce in fp32.
    return values.float() if values.dtype in (torch.bfloat16, torch.float16) else values


def _zero(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=like.dtype, device=like.device)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Sum of ``values`` over counted positions (over all elements, or along ``dim``)."""
    selected = torch.where(_valid(mask), _upcast(values), _zero(_upcast(values)))
    total = selected.sum() if dim is None else selected.sum(dim=dim)
    return total.to(values.dtype)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """``sum(values * mask) / max(sum(mask), 1)``; 0 where nothing is counted.

    Clamping the count (rather than verl's ``+ 1e-8``) gives an exact mean and a clean 0 for
    empty rows without a host sync.
    """
    valid = _valid(mask)
    count = valid.sum() if dim is None else valid.sum(dim=dim)
    mean = masked_sum(_upcast(values), valid, dim) / count.clamp(min=1)
    return mean.to(values.dtype)


def masked_var(
    values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True, dim: Optional[int] = None
) -> torch.Tensor:
    """Masked variance; ``unbiased`` applies Bessel's correction ``n / (n - 1)``.

    With n <= 1 counted elements the unbiased variance is undefined; verl raises there, which
    needs a device->host sync. We clamp ``n - 1`` to 1 instead, giving 0 (no spread observed).
    """
    valid = _valid(mask)
    x = _upcast(values)
    mean = masked_mean(x, valid, dim)
    centered = x - (mean if dim is None else mean.unsqueeze(dim))
    var = masked_mean(centered.square(), valid, dim)
    if unbiased:
        n = (valid.sum() if dim is None else valid.sum(dim=dim)).to(x.dtype)
        var = var * n / (n - 1).clamp(min=1)
    return var.to(values.dtype)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Whiten over all counted elements: ``(x - mean) * rsqrt(var + 1e-8)``.

    ``var`` is the unbiased masked variance. If not ``shift_mean`` the mean is added back
    (only the scale is normalised). Masked positions are returned as 0.
    """
    valid = _valid(mask)
    x = _upcast(values)
    mean = masked_mean(x, valid)
    var = masked_var(x, valid, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(valid, whitened, _zero(whitened)).to(values.dtype)


def _at_least_one(count: Count) -> Count:
    # An all-masked (micro-)batch sums to 0, so any positive denominator gives the right 0.
    return count.clamp(min=1) if isinstance(count, torch.Tensor) else max(count, 1)


def _seq_share(seq_losses: torch.Tensor, valid: torch.Tensor, global_num_seqs: Optional[Count]) -> torch.Tensor:
    """Sum of per-row losses over rows with >= 1 valid token, divided by the row count."""
    alive = valid.any(dim=-1)
    total = masked_sum(seq_losses, alive)
    denominator = alive.sum() if global_num_seqs is None else global_num_seqs
    return total / _at_least_one(denominator)


@register_agg_mode("token-mean")
def _token_mean(loss_mat, valid, *, global_num_tokens=None, global_num_seqs=None, loss_scale_factor=None):
    denominator = valid.sum() if global_num_tokens is None else global_num_tokens
    return masked_sum(loss_mat, valid) / _at_least_one(denominator)


@register_agg_mode("seq-mean-token-sum")
def _seq_mean_token_sum(loss_mat, valid, *, global_num_tokens=None, global_num_seqs=None, loss_scale_factor=None):
    return _seq_share(masked_sum(loss_mat, valid, dim=-1), valid, global_num_seqs)


@register_agg_mode("seq-mean-token-mean")
def _seq_mean_token_mean(loss_mat, valid, *, global_num_tokens=None, global_num_seqs=None, loss_scale_factor=None):
    return _seq_share(masked_mean(loss_mat, valid, dim=-1), valid, global_num_seqs)


@register_agg_mode("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(loss_mat, valid, *, global_num_tokens=None, global_num_seqs=None,
                             loss_scale_factor=None):
    # Dr. GRPO as verl 0.9.1 aggregates it: seq-mean-token-sum divided by one constant (the
    # configured response length), so long and short responses are not re-weighted by their length.
    scale = loss_mat.shape[-1] if loss_scale_factor is None else loss_scale_factor
    return _seq_share(masked_sum(loss_mat, valid, dim=-1), valid, global_num_seqs) / scale


@register_agg_mode("token-sum")
def _token_sum(loss_mat, valid, *, global_num_tokens=None, global_num_seqs=None, loss_scale_factor=None):
    # A plain sum over valid tokens: a micro-batch's share is its own sum, no count enters. The
    # gradient grows with the batch's token count, so the learning rate must be set for it.
    return masked_sum(loss_mat, valid)


def agg_loss(
    *,
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    global_num_tokens: Optional[Count] = None,
    global_num_seqs: Optional[Count] = None,
    loss_scale_factor: Optional[Count] = None,
) -> torch.Tensor:
    """Aggregate a (B, T) per-token loss into a 0-dim tensor.

    Modes (m = mask, n_i = sum_t m_it, S = rows with n_i > 0):

    * ``token-mean``: ``sum_it l_it m_it / N``, N = ``global_num_tokens`` or ``sum n_i``;
    * ``seq-mean-token-sum``: ``sum_{i in S} (sum_t l_it m_it) / M``;
    * ``seq-mean-token-mean``: ``sum_{i in S} (sum_t l_it m_it / n_i) / M``;
    * ``seq-mean-token-sum-norm``: ``sum_{i in S} (sum_t l_it m_it) / (M c)``, c = ``loss_scale_factor``
      or T (verl's name and fall-back; the trainer passes a constant, never a micro-batch's own T);
    * ``token-sum``: ``sum_it l_it m_it`` (no denominator);

    with M = ``global_num_seqs`` (verl's global_batch_size: every row of the mini-batch, fully masked
    ones included) or, without it, ``|S|``. See the module docstring for how the global
    counts make micro-batch results sum to the full-batch value. An all-masked input gives 0.
    """
    fn = AGG_MODES.get(loss_agg_mode)
    loss = fn(
        _upcast(loss_mat),
        _valid(loss_mask),
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        loss_scale_factor=loss_scale_factor,
    )
    return loss.to(loss_mat.dtype)


def global_counts(response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid tokens, rows) of a mask: the local terms that a trainer sums over micro-batches (and
    all-reduces over ranks) to get the global counts. Every row counts, fully masked ones too, as
    verl's ``global_batch_size`` counts every sequence of the mini-batch."""
    valid = _valid(response_mask)
    return valid.sum(), torch.tensor(valid.shape[0], device=valid.device)
