"""Policy-loss variants selected by ``actor.policy_loss.loss_mode``, with verl 0.9.1's semantics
(verl/trainer/ppo/core_algos.py): ``gspo``, ``sapo``, ``gpg``, ``clip_cov``, ``kl_cov``, ``geo_mean``,
``cispo``, ``dro``, ``dppo_tv``, ``dppo_kl`` and ``bypass_mode``.

Contract shared with ``losses.compute_policy_loss`` ("vanilla"): keyword-only (B, T) tensors
``old_log_prob``, ``log_prob``, ``advantages``, ``response_mask``, and ``rollout_is_weights`` (B, T) or
None: rollout-correction importance weights, multiplied into the per-token loss before aggregation
(``rollout_correction``). Each mode names only the knobs it uses (the caller offers all of them, see
``registry.accepted_kwargs``). Each returns ``(loss, metrics)``: ``loss`` 0-dim, aggregated through
``agg_loss`` with the global counts so micro-batch losses add up to the mini-batch loss (see
``aggregation``); ``metrics`` the detached 0-dim tensors ``pg_clipfrac``, ``pg_clipfrac_lower``,
``ppo_kl``, plain masked means over this call's valid tokens, and exactly 0 where a mode has no such
quantity (each docstring says which); ``bypass_mode`` adds verl's ``rollout_corr/...`` metrics.

Inputs are zeroed at masked positions before any arithmetic: with inf/nan there, ``0 * inf`` in the
backward of the excluded terms would put nan into the gradient of the model.
"""

from __future__ import annotations

from typing import Optional

import torch

from .aggregation import Count, agg_loss, masked_mean, masked_sum
from .losses import compute_policy_loss
from .registry import register_policy_loss
from .correction_specs import LOSS_TYPES, RolloutCorrection
from .rollout_correction import correct_rollout

# gspo: verl clamps the per-token log of the sequence ratio from above for stability.
GSPO_MAX_LOG_RATIO = 10.0
# Every mode that exponentiates a log-ratio clamps it to +-20 first (exp(20) ~ 4.9e8), as verl.
LOG_RATIO_BOUND = 20.0

Metrics = dict[str, torch.Tensor]


def _valid(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def _zero_padding(valid: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device)) for x in tensors]


def _weighted(pg_losses: torch.Tensor, rollout_is_weights: Optional[torch.Tensor], valid: torch.Tensor) -> torch.Tensor:
    """Per-token losses times the rollout-correction weights (constants), when there are any."""
    if rollout_is_weights is None:
        return pg_losses
    return pg_losses * torch.where(valid, rollout_is_weights.detach(), torch.zeros((), dtype=pg_losses.dtype))


def _metrics(pg_clipfrac=None, pg_clipfrac_lower=None, ppo_kl=None, *, like: torch.Tensor) -> Metrics:
    """The three logged quantities, detached; a missing one is an exact 0."""
    zero = torch.zeros((), dtype=torch.float32, device=like.device)
    values = {"pg_clipfrac": pg_clipfrac, "pg_clipfrac_lower": pg_clipfrac_lower, "ppo_kl": ppo_kl}
    return {k: (zero if v is None else v.detach()) for k, v in values.items()}


def _require_positive(name: str, value: Optional[float], key: str = "actor.policy_loss") -> None:
    if value is None or not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}; set {key}.{name}")


def _aggregate(pg_losses: torch.Tensor, valid: torch.Tensor, loss_agg_mode: str, global_num_tokens: Optional[Count],
               global_num_seqs: Optional[Count], loss_scale_factor: Optional[Count]) -> torch.Tensor:
    return agg_loss(loss_mat=pg_losses, loss_mask=valid, loss_agg_mode=loss_agg_mode,
                    global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs,
                    loss_scale_factor=loss_scale_factor)


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: Optional[Count] = None,
    global_num_seqs: Optional[Count] = None,
    loss_scale_factor: Optional[Count] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Metrics]:
    """GSPO (Zheng et al. 2025, https://arxiv.org/abs/2507.18071): a sequence-level ratio
    ``s_i = exp(mean_t (log_prob - old_log_prob))`` over row i's valid tokens, applied per token as
    ``s_it = exp(min(sg[log s_i] + log_prob - sg[log_prob], 10))`` (value s_i, gradient that of
    log_prob scaled by s_i), in PPO's clipped surrogate ``max(-A s_it, -A clip(s_it, 1 - low, 1 + high))``.

    Aggregated with ``loss_agg_mode`` like every other mode (verl's default token-mean; the paper's
    sequence-level unit is ``seq-mean-token-mean``). No dual clip. Metrics: ``pg_clipfrac`` (valid
    tokens where the clipped term is larger), ``ppo_kl`` (mean of old_log_prob - log_prob, unclamped);
    ``pg_clipfrac_lower`` is 0 (GSPO has no dual clip).
    """
    valid = _valid(response_mask)
    old_log_prob, log_prob, advantages = _zero_padding(valid, old_log_prob, log_prob, advantages)
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_sum(log_ratio, valid, dim=-1) / valid.sum(dim=-1).clamp(min=1)
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(token_log_ratio, max=GSPO_MAX_LOG_RATIO))
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = _weighted(torch.maximum(loss_unclipped, loss_clipped), rollout_is_weights, valid)
    loss = _aggregate(pg_losses, valid, loss_agg_mode, global_num_tokens, global_num_seqs, loss_scale_factor)
    with torch.no_grad():
        metrics = _metrics(pg_clipfrac=masked_mean((loss_clipped > loss_unclipped).float(), valid),
                           ppo_kl=masked_mean(-log_ratio, valid), like=loss)
    return loss, metrics


@register_policy_loss("sapo")
def compute_policy_loss_sapo(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    global_num_seqs: Optional[Count] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Metrics]:
    """SAPO (https://arxiv.org/abs/2511.20347): a smooth gate instead of a hard clip. With
    ``r = exp(clamp(log_prob - old_log_prob, +-20))`` and ``tau = tau_pos`` where A > 0 else ``tau_neg``
    (actor.tau_pos / tau_neg), the per-token loss is ``-A * f(r)``, ``f(r) = sigmoid(tau (r - 1)) * 4 / tau``
    (slope 1 at r = 1, flattening as r leaves 1).

    Aggregated as ``seq-mean-token-mean`` whatever actor.loss_agg_mode says, as verl does. Metrics:
    ``ppo_kl``; ``pg_clipfrac`` and ``pg_clipfrac_lower`` are 0 (nothing is clipped).
    """
    valid = _valid(response_mask)
    old_log_prob, log_prob, advantages = _zero_padding(valid, old_log_prob, log_prob, advantages)
    log_ratio = torch.clamp(log_prob - old_log_prob, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    tau = torch.where(advantages > 0, torch.as_tensor(tau_pos, dtype=advantages.dtype),
                      torch.as_tensor(tau_neg, dtype=advantages.dtype))
    gate = torch.sigmoid(tau * (torch.exp(log_ratio) - 1.0)) * (4.0 / tau)
    pg_losses = _weighted(-gate * advantages, rollout_is_weights, valid)
    loss = agg_loss(loss_mat=pg_losses, loss_mask=valid, loss_agg_mode="seq-mean-token-mean",
                    global_num_seqs=global_num_seqs)
    with torch.no_grad():
        metrics = _metrics(ppo_kl=masked_mean(-log_ratio, valid), like=loss)
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
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Metrics]:
    """GPG (Chu et al. 2025, https://arxiv.org/abs/2504.02546): the plain policy gradient
    ``agg(-A * log_prob)``: no ratio, no clipping, so old_log_prob is not read.

    Metrics: all three are 0 (verl logs none for gpg: nothing is clipped and no ratio is formed).
    """
    valid = _valid(response_mask)
    log_prob, advantages = _zero_padding(valid, log_prob, advantages)
    pg_losses = _weighted(-advantages * log_prob, rollout_is_weights, valid)
    loss = _aggregate(pg_losses, valid, loss_agg_mode, global_num_tokens, global_num_seqs, loss_scale_factor)
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
    rollout_is_weights: Optional[torch.Tensor] = None,
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
        picked = positions[torch.randperm(len(positions))[:draw].to(positions.device)] if len(positions) else positions
        keep = torch.ones_like(loss_unclipped)
        keep[picked[:, 0], picked[:, 1]] = 0
    pg_losses = _weighted(torch.maximum(loss_unclipped, loss_clipped) * keep, rollout_is_weights, valid)
    loss = _aggregate(pg_losses, valid, loss_agg_mode, global_num_tokens, global_num_seqs, loss_scale_factor)
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
    rollout_is_weights: Optional[torch.Tensor] = None,
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
    pg_losses = _weighted(torch.where(penalised, loss_plain + ppo_kl_coef * abs_kl, loss_plain),
                          rollout_is_weights, valid)
    loss = _aggregate(pg_losses, valid, loss_agg_mode, global_num_tokens, global_num_seqs, loss_scale_factor)
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
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Metrics]:
    """GMPO (Zhao et al. 2025, https://arxiv.org/abs/2507.20673): per row, the geometric mean of the
    token ratios, each log-ratio clipped pessimistically by the advantage's sign,
    ``l_t = sgn(A) * min(sgn(A) * log r_t, sgn(A) * clip(log r_t, -low, high))``, gives
    ``R_i = exp(mean_t l_t)``; with the row's mean advantage ``Abar_i`` the row loss is ``-Abar_i R_i``
    (times the geometric mean of the row's rollout-correction weights, when given). Sequence-level
    advantages are assumed, as in verl.

    The loss is the mean over rows whatever actor.loss_agg_mode says, as verl's (a fully masked row
    counts, with loss 0); with ``global_num_seqs`` the row sum over that count, so micro-batch shares
    add up.

    Metrics: ``pg_clipfrac`` / ``pg_clipfrac_lower`` (valid tokens whose log-ratio lies outside
    [-low, high] with A > 0 / A < 0), ``ppo_kl`` (mean of old_log_prob - log_prob, unclamped).
    """
    valid = _valid(response_mask)
    old_log_prob, log_prob, advantages = _zero_padding(valid, old_log_prob, log_prob, advantages)
    log_ratio = log_prob - old_log_prob
    sign = torch.sign(advantages)
    log_ratio_clamped = torch.clamp(log_ratio, -clip_ratio_low, clip_ratio_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * log_ratio_clamped)
    lengths = valid.sum(dim=-1).clamp(min=1)
    seq_ratio = torch.exp(masked_sum(pessimistic, valid, dim=-1) / lengths)
    seq_advantage = masked_sum(advantages, valid, dim=-1) / lengths
    row_loss = -seq_advantage * seq_ratio
    if rollout_is_weights is not None:
        log_weights = torch.log(torch.where(valid, rollout_is_weights.detach(), 1.0) + 1e-10)
        row_loss = row_loss * torch.exp(masked_sum(log_weights, valid, dim=-1) / lengths)
    rows = row_loss.shape[0] if global_num_seqs is None else global_num_seqs
    loss = row_loss.sum() / (rows if isinstance(rows, torch.Tensor) else max(rows, 1))
    with torch.no_grad():
        clipped = log_ratio != log_ratio_clamped
        metrics = _metrics(pg_clipfrac=masked_mean((clipped & (advantages > 0)).float(), valid),
                           pg_clipfrac_lower=masked_mean((clipped & (advantages < 0)).float(), valid),
                           ppo_kl=masked_mean(-log_ratio, valid), like=loss)
    return loss, metrics


@register_policy_loss("cispo")
def compute_policy_loss_cispo(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: Optional[Count] = None,
    global_num_seqs: Optional[Count] = None,
    loss_scale_factor: Optional[Count] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Metrics]:
    """CISPO (MiniMax-M1, https://arxiv.org/abs/2506.13585): clip the importance weight, not the update.
    With ``r = exp(clamp(log_prob - old_log_prob, +-20))`` the per-token loss is
    ``-sg[clip(r, 1 - low, 1 + high)] * A * log_prob``: every token keeps a gradient (through log_prob),
    scaled by its clipped, constant weight.

    Metrics: ``pg_clipfrac`` (valid tokens whose weight was clipped), ``ppo_kl``; ``pg_clipfrac_lower``
    is 0.
    """
    valid = _valid(response_mask)
    old_log_prob, log_prob, advantages = _zero_padding(valid, old_log_prob, log_prob, advantages)
    log_ratio = torch.clamp(log_prob - old_log_prob, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = _weighted(-clipped.detach() * advantages * log_prob, rollout_is_weights, valid)
    loss = _aggregate(pg_losses, valid, loss_agg_mode, global_num_tokens, global_num_seqs, loss_scale_factor)
    with torch.no_grad():
        metrics = _metrics(pg_clipfrac=masked_mean((ratio != clipped).float(), valid),
                           ppo_kl=masked_mean(-log_ratio, valid), like=loss)
    return loss, metrics


@register_policy_loss("dro")
def compute_policy_loss_dro(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    dro_beta: Optional[float] = None,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: Optional[Count] = None,
    global_num_seqs: Optional[Count] = None,
    loss_scale_factor: Optional[Count] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Metrics]:
    """DRO (Direct Reward Optimization, https://arxiv.org/abs/2405.19107): the policy gradient with a
    quadratic penalty on the log-ratio, ``-(A * log_prob - beta / 2 * (log_prob - old_log_prob)^2)``;
    ``beta`` = actor.policy_loss.dro_beta, required (> 0).

    Metrics: ``ppo_kl``; ``pg_clipfrac`` and ``pg_clipfrac_lower`` are 0.
    """
    _require_positive("dro_beta", dro_beta)
    valid = _valid(response_mask)
    old_log_prob, log_prob, advantages = _zero_padding(valid, old_log_prob, log_prob, advantages)
    log_ratio = log_prob - old_log_prob
    pg_losses = _weighted(-(log_prob * advantages - 0.5 * dro_beta * log_ratio.square()), rollout_is_weights, valid)
    loss = _aggregate(pg_losses, valid, loss_agg_mode, global_num_tokens, global_num_seqs, loss_scale_factor)
    with torch.no_grad():
        metrics = _metrics(ppo_kl=masked_mean(-log_ratio, valid), like=loss)
    return loss, metrics


def _dppo(*, old_log_prob, log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high, clip_ratio_c,
          loss_agg_mode, global_num_tokens, global_num_seqs, loss_scale_factor, rollout_is_weights, divergence):
    """DPPO's shared body: ``-A * sg[min(r, c)] * log_prob`` on tokens whose divergence between the old
    and new token probabilities stays inside the trust region for the advantage's direction
    (``divergence(prob, old_prob, old_log_prob, log_prob, A)`` → kept mask), 0 elsewhere."""
    valid = _valid(response_mask)
    old_log_prob, log_prob, advantages = _zero_padding(valid, old_log_prob, log_prob, advantages)
    log_ratio = torch.clamp(log_prob - old_log_prob, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    truncated = torch.clamp(ratio, max=clip_ratio_c).detach()
    with torch.no_grad():
        kept = divergence(torch.exp(log_prob), torch.exp(old_log_prob), old_log_prob, log_prob, advantages,
                          clip_ratio_low, clip_ratio_high).to(log_prob.dtype)
    pg_losses = _weighted(-advantages * truncated * log_prob * kept, rollout_is_weights, valid)
    loss = _aggregate(pg_losses, valid, loss_agg_mode, global_num_tokens, global_num_seqs, loss_scale_factor)
    with torch.no_grad():
        metrics = _metrics(pg_clipfrac=masked_mean(1.0 - kept, valid),
                           pg_clipfrac_lower=masked_mean((ratio > clip_ratio_c).to(kept.dtype) * kept, valid),
                           ppo_kl=masked_mean(-log_ratio, valid), like=loss)
    return loss, metrics


def _tv_region(prob, old_prob, old_log_prob, log_prob, advantages, low, high):
    change = prob - old_prob
    return torch.where(advantages > 0, change <= high, change >= -low)


def _binary_kl_region(prob, old_prob, old_log_prob, log_prob, advantages, low, high):
    # KL between the Bernoulli "this token / any other token" of the old and the new policy.
    binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
        (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
    return torch.where(advantages > 0, (binary_kl <= high) | (prob <= old_prob), (binary_kl <= low) | (prob >= old_prob))


@register_policy_loss("dppo_tv")
def compute_policy_loss_dppo_tv(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: Optional[Count] = None,
    global_num_seqs: Optional[Count] = None,
    loss_scale_factor: Optional[Count] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Metrics]:
    """DPPO with a binary total-variation trust region (https://arxiv.org/abs/2602.04879): a token
    with A > 0 trains while its probability rose by at most ``clip_ratio_high`` (an absolute change,
    not a ratio), one with A <= 0 while it fell by at most ``clip_ratio_low``; the loss is
    ``-A * sg[min(r, clip_ratio_c)] * log_prob`` (truncated IS instead of a dual clip).

    Metrics: ``pg_clipfrac`` (tokens outside the region), ``pg_clipfrac_lower`` (kept tokens whose ratio
    was truncated), ``ppo_kl``.
    """
    return _dppo(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask,
                 clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c,
                 loss_agg_mode=loss_agg_mode, global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs,
                 loss_scale_factor=loss_scale_factor, rollout_is_weights=rollout_is_weights, divergence=_tv_region)


@register_policy_loss("dppo_kl")
def compute_policy_loss_dppo_kl(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: Optional[Count] = None,
    global_num_seqs: Optional[Count] = None,
    loss_scale_factor: Optional[Count] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Metrics]:
    """DPPO with a binary-KL trust region (https://arxiv.org/abs/2602.04879): as ``dppo_tv``, but a
    token leaves the region when the KL between the old and new Bernoulli(token probability) exceeds
    ``clip_ratio_high`` (A > 0, probability rising) or ``clip_ratio_low`` (A <= 0, falling); a move in
    the advantage's favourable-and-safe direction is always kept.

    Metrics: as ``dppo_tv``.
    """
    return _dppo(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask,
                 clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c,
                 loss_agg_mode=loss_agg_mode, global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs,
                 loss_scale_factor=loss_scale_factor, rollout_is_weights=rollout_is_weights,
                 divergence=_binary_kl_region)


@register_policy_loss("bypass_mode")
def compute_policy_loss_bypass_mode(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: Optional[Count] = None,
    global_num_seqs: Optional[Count] = None,
    loss_scale_factor: Optional[Count] = None,
    rollout_correction: Optional[RolloutCorrection] = None,
) -> tuple[torch.Tensor, Metrics]:
    """verl's bypass mode: ``old_log_prob`` *is* the rollout engine's log-prob (no recomputed old
    policy). Rollout correction is computed inside the loss from the current policy against it
    (weights, rejection mask, ``rollout_corr/...`` metrics), then:

    * ``loss_type="ppo_clip"``: the vanilla clipped loss on the rejection-masked tokens (the ratio
      pi / pi_rollout already is the correction: no weights on top);
    * ``loss_type="reinforce"``: ``-A * w * log_prob`` with the (constant) weights, ``ppo_kl`` the mean
      of log pi_rollout - log pi.

    ``rollout_correction`` holds algorithm.rollout_correction's settings and is required.
    """
    if rollout_correction is None:
        raise ValueError("loss_mode=bypass_mode needs algorithm.rollout_correction (set "
                         "algorithm.rollout_correction.bypass_mode=true, which also selects this loss)")
    if rollout_correction.loss_type not in LOSS_TYPES:
        raise ValueError(f"algorithm.rollout_correction.loss_type must be one of {LOSS_TYPES}, "
                         f"got {rollout_correction.loss_type!r}")
    valid = _valid(response_mask)
    old_log_prob, advantages = _zero_padding(valid, old_log_prob, advantages)
    weights, kept, correction = None, valid, {}
    if bool(valid.any()):  # a call without tokens (a filler micro-batch) has nothing to correct
        with torch.no_grad():
            weights, mask, correction = correct_rollout(
                old_log_prob=torch.where(valid, log_prob.detach(), 0.0), rollout_log_prob=old_log_prob,
                response_mask=valid.to(old_log_prob.dtype), settings=rollout_correction)
        kept = mask != 0
    counts = dict(loss_agg_mode=loss_agg_mode, global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs,
                  loss_scale_factor=loss_scale_factor)
    if rollout_correction.loss_type == "ppo_clip":
        loss, metrics = compute_policy_loss(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages,
                                            response_mask=kept, clip_ratio_low=clip_ratio_low,
                                            clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c, **counts)
    else:
        (log_prob,) = _zero_padding(kept, log_prob)
        pg_losses = _weighted(-advantages * log_prob, weights, kept)
        loss = _aggregate(pg_losses, kept, **counts)
        with torch.no_grad():
            metrics = _metrics(ppo_kl=masked_mean(old_log_prob - log_prob, kept), like=loss)
    return loss, {**metrics, **{k: v.detach() for k, v in correction.items()}}
