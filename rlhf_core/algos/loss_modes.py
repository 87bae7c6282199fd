"""Policy-loss variants selected by ``actor.policy_loss.loss_mode``, with verl's semantics
(verl/trainer/ppo/core_algos.py): ``gspo``, ``gpg``, ``clip_cov``, ``kl_cov``, ``geo_mean``.

Contract shared with ``losses.compute_policy_loss`` ("vanilla"): keyword-only (B, T) tensors
``old_log_prob``, ``log_prob``, ``advantages``, ``response_mask``; each mode names only the knobs it
uses (the caller offers all of them, see ``registry.accepted_kwargs``). Each returns ``(loss,
metrics)``: ``loss`` 0-dim, aggregated through ``agg_loss`` with the global counts so micro-batch
losses add up to the mini-batch loss (see ``aggregation``); ``metrics`` the detached 0-dim tensors
``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl``, plain masked means over this call's valid tokens,
and exactly 0 where a mode has no such quantity (each docstring says which).

Inputs are zeroed at masked positions before any arithmetic: with inf/nan there, ``0 * inf`` in the
backward of the excluded terms would put nan into the gradient of the model.

verl's ``rollout_is_weights`` (rollout-correction importance weights) are not an input here: every
mode behaves as verl does when they are None.
"""

from __future__ import annotations

from typing import Optional

import torch

from .aggregation import Count, agg_loss, masked_mean, masked_sum
from .registry import register_policy_loss

# gspo: verl clamps the per-token log of the sequence ratio from above for stability.
GSPO_MAX_LOG_RATIO = 10.0

Metrics = dict[str, torch.Tensor]


def _valid(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def _zero_padding(valid: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device)) for x in tensors]


def _metrics(pg_clipfrac=None, pg_clipfrac_lower=None, ppo_kl=None, *, like: torch.Tensor) -> Metrics:
    """The three logged quantities, detached; a missing one is an exact 0."""
    zero = torch.zeros((), dtype=torch.float32, device=like.device)
    values = {"pg_clipfrac": pg_clipfrac, "pg_clipfrac_lower": pg_clipfrac_lower, "ppo_kl": ppo_kl}
    return {k: (zero if v is None else v.detach()) for k, v in values.items()}


def _require_positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}; set actor.policy_loss.{name} to a share such as 0.0002")


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    global_num_seqs: Optional[Count] = None,
) -> tuple[torch.Tensor, Metrics]:
    """GSPO (Zheng et al. 2025, https://arxiv.org/abs/2507.18071): a sequence-level ratio
    ``s_i = exp(mean_t (log_prob - old_log_prob))`` over row i's valid tokens, applied per token as
    ``s_it = exp(min(sg[log s_i] + log_prob - sg[log_prob], 10))`` (value s_i, gradient that of
    log_prob scaled by s_i), in PPO's clipped surrogate ``max(-A s_it, -A clip(s_it, 1 - low, 1 + high))``.

    Aggregation is forced to ``seq-mean-token-mean`` whatever actor.loss_agg_mode says, as verl does
    (the sequence is GSPO's unit), so only ``global_num_seqs`` enters. No dual clip. Metrics:
    ``pg_clipfrac`` (valid tokens where the clipped term is larger), ``ppo_kl`` (mean of
    old_log_prob - log_prob, unclamped); ``pg_clipfrac_lower`` is 0 (GSPO has no dual clip).
    """
    valid = _valid(response_mask)
    old_log_prob, log_prob, advantages = _zero_padding(valid, old_log_prob, log_prob, advantages)
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_sum(log_ratio, valid, dim=-1) / valid.sum(dim=-1).clamp(min=1)
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(token_log_ratio, max=GSPO_MAX_LOG_RATIO))
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    loss = agg_loss(loss_mat=torch.maximum(loss_unclipped, loss_clipped), loss_mask=valid,
                    loss_agg_mode="seq-mean-token-mean", global_num_seqs=global_num_seqs)
    with torch.no_grad():
        metrics = _metrics(pg_clipfrac=masked_mean((loss_clipped > loss_unclipped).float(), valid),
                           ppo_kl=masked_mean(-log_ratio, valid), like=loss)
    return loss, metrics


@register_policy_loss("gpg")
def compute_policy_loss_gpg(
    *,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: Optional[Count] = None,
    global_num_seqs: Optional[Count] = None,
    loss_scale_factor: Optional[Count] = None,
) -> tuple[torch.Tensor, Metrics]:
    """GPG (Chu et al. 2025, https://arxiv.org/abs/2504.02546): the plain policy gradient
    ``agg(-A * log_prob)``: no ratio, no clipping, so old_log_prob is not read.

    Metrics: all three are 0 (verl logs none for gpg: nothing is clipped and no ratio is formed).
    """
    valid = _valid(response_mask)
    log_prob, advantages = _zero_padding(valid, log_prob, advantages)
    loss = agg_loss(loss_mat=-advantages * log_prob, loss_mask=valid, loss_agg_mode=loss_agg_mode,
                    global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs,
                    loss_scale_factor=loss_scale_factor)
    return loss, _metrics(like=loss)


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: Optional[Count] = None,
    global_num_seqs: Optional[Count] = None,
    loss_scale_factor: Optional[Count] = None,
) -> tuple[torch.Tensor, Metrics]:
    """Clip-Cov (Cui et al. 2025, https://arxiv.org/abs/2505.22617): PPO's clipped surrogate
    ``max(-A r, -A clip(r, 1 - low, 1 + high))`` with r = exp(log_prob - old_log_prob) (unclamped, no dual
    clip), except that a few tokens with a large covariance between advantage and log-prob get
    loss (and gradient) 0, to keep entropy from collapsing.

    Covariance per valid token: ``(A - mean A) * (log_prob - mean log_prob)``, means over this call's
    valid tokens. Candidates: valid tokens not already clipped by PPO with ``clip_cov_lb < cov <
    clip_cov_ub``. ``max(int(clip_cov_ratio * valid tokens of this call), 1)`` of them are drawn at random
    (``torch.randperm`` on the default CPU generator, as verl, so seeding torch reproduces the draw).
    As in verl the count and the means are per call (micro-batch), not per mini-batch.

    Metrics: ``pg_clipfrac`` (valid tokens whose loss was zeroed by the draw, verl's meaning for this
    mode), ``ppo_kl`` (mean of old_log_prob - log_prob); ``pg_clipfrac_lower`` is 0 (no dual clip).
    """
    _require_positive("clip_cov_ratio", clip_cov_ratio)
    valid = _valid(response_mask)
    old_log_prob, log_prob, advantages = _zero_padding(valid, old_log_prob, log_prob, advantages)
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    with torch.no_grad():
        policy = log_prob.detach()
        cov = (advantages - masked_mean(advantages, valid)) * (policy - masked_mean(policy, valid))
        candidates = valid & ~(loss_clipped > loss_unclipped) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
        positions = torch.nonzero(candidates)
        draw = max(int(clip_cov_ratio * int(valid.sum())), 1)
        picked = positions[torch.randperm(len(positions))[:draw].to(positions.device)]
        keep = torch.ones_like(loss_unclipped)
        keep[picked[:, 0], picked[:, 1]] = 0
    pg_losses = torch.maximum(loss_unclipped, loss_clipped) * keep
    loss = agg_loss(loss_mat=pg_losses, loss_mask=valid, loss_agg_mode=loss_agg_mode,
                    global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs,
                    loss_scale_factor=loss_scale_factor)
    with torch.no_grad():
        metrics = _metrics(pg_clipfrac=masked_mean((keep == 0).float(), valid),
                           ppo_kl=masked_mean(-log_ratio, valid), like=loss)
    return loss, metrics


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 0.1,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: Optional[Count] = None,
    global_num_seqs: Optional[Count] = None,
    loss_scale_factor: Optional[Count] = None,
) -> tuple[torch.Tensor, Metrics]:
    """KL-Cov (Cui et al. 2025, https://arxiv.org/abs/2505.22617): the unclipped surrogate ``-A r``
    with r = exp(log_prob - old_log_prob) (no clamp, no clip), plus ``ppo_kl_coef * |log r|`` on the
    ``max(1, int(kl_cov_ratio * valid tokens of this call))`` valid tokens with the largest covariance
    ``(A - mean A) * (log_prob - mean log_prob)`` (means over this call's valid tokens, as verl: per
    micro-batch). A call without valid tokens selects none.

    Metrics: ``ppo_kl`` is the mean of ``|old_log_prob - log_prob|`` (verl logs the absolute value for
    this mode); ``pg_clipfrac`` and ``pg_clipfrac_lower`` are 0 (nothing is clipped).
    """
    _require_positive("kl_cov_ratio", kl_cov_ratio)
    valid = _valid(response_mask)
    old_log_prob, log_prob, advantages = _zero_padding(valid, old_log_prob, log_prob, advantages)
    log_ratio = log_prob - old_log_prob
    abs_kl = log_ratio.abs()
    loss_plain = -advantages * torch.exp(log_ratio)
    with torch.no_grad():
        flat_valid = valid.flatten()
        adv, policy = advantages.flatten()[flat_valid], log_prob.detach().flatten()[flat_valid]
        penalised = torch.zeros_like(flat_valid)
        if adv.numel() > 0:
            cov = (adv - adv.mean()) * (policy - policy.mean())
            top = torch.topk(cov, max(1, int(adv.numel() * kl_cov_ratio))).indices
            penalised[torch.nonzero(flat_valid).flatten()[top]] = True
        penalised = penalised.view_as(valid)
    pg_losses = torch.where(penalised, loss_plain + ppo_kl_coef * abs_kl, loss_plain)
    loss = agg_loss(loss_mat=pg_losses, loss_mask=valid, loss_agg_mode=loss_agg_mode,
                    global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs,
                    loss_scale_factor=loss_scale_factor)
    with torch.no_grad():
        metrics = _metrics(ppo_kl=masked_mean(abs_kl, valid), like=loss)
    return loss, metrics


@register_policy_loss("geo_mean")
def compute_policy_loss_geo_mean(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    global_num_seqs: Optional[Count] = None,
) -> tuple[torch.Tensor, Metrics]:
    """GMPO (Zhao et al. 2025, https://arxiv.org/abs/2507.20673): per row, the geometric mean of the
    token ratios, each log-ratio clipped pessimistically by the advantage's sign,
    ``l_t = sgn(A) * min(sgn(A) * log r_t, sgn(A) * clip(log r_t, -low, high))``, gives
    ``R_i = exp(mean_t l_t)``; with the row's mean advantage ``Abar_i`` the row loss is ``-Abar_i R_i``.
    (Sequence-level advantages are assumed, as in verl.)

    Aggregation is forced to a mean over rows whatever actor.loss_agg_mode says, as verl does; here
    the rows are those with at least one valid token and the denominator is ``global_num_seqs``, so
    micro-batch shares add up. verl's ``torch.mean`` also counts fully masked rows (loss 0) in the
    denominator; the values agree whenever no row is fully masked.

    Metrics: ``pg_clipfrac`` / ``pg_clipfrac_lower`` (valid tokens whose log-ratio lies outside
    [-low, high] with A > 0 / A < 0), ``ppo_kl`` (mean of old_log_prob - log_prob, unclamped).
    """
    valid = _valid(response_mask)
    old_log_prob, log_prob, advantages = _zero_padding(valid, old_log_prob, log_prob, advantages)
    log_ratio = log_prob - old_log_prob
    sign = torch.sign(advantages)
    log_ratio_clamped = torch.clamp(log_ratio, -clip_ratio_low, clip_ratio_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * log_ratio_clamped)
    lengths = valid.sum(dim=-1)
    seq_ratio = torch.exp(masked_sum(pessimistic, valid, dim=-1) / lengths.clamp(min=1))
    seq_advantage = masked_sum(advantages, valid, dim=-1) / lengths.clamp(min=1)
    row_loss = -seq_advantage * seq_ratio
    # One "token" per row holding the row's loss: seq-mean-token-sum is then the mean over rows.
    loss = agg_loss(loss_mat=row_loss.unsqueeze(-1), loss_mask=(lengths > 0).unsqueeze(-1),
                    loss_agg_mode="seq-mean-token-sum", global_num_seqs=global_num_seqs)
    with torch.no_grad():
        clipped = log_ratio != log_ratio_clamped
        metrics = _metrics(pg_clipfrac=masked_mean((clipped & (advantages > 0)).float(), valid),
                           pg_clipfrac_lower=masked_mean((clipped & (advantages < 0)).float(), valid),
                           ppo_kl=masked_mean(-log_ratio, valid), like=loss)
    return loss, metrics
