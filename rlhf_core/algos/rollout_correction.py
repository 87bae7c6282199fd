"""Rollout correction: importance weights and rejection masks for the gap between the policy that
sampled (the rollout engine: vLLM in bf16, say) and the policy the trainer computes (fp32).

verl's ``algorithm.rollout_correction`` under verl's names and semantics (verl 0.9.1,
``trainer/ppo/rollout_corr_helper.py``). All tensors are (B, T); ``log_ratio`` is
``log pi_train - log pi_rollout`` per token; masks are 1 for a counted token.

* **Importance sampling** (``rollout_is``): ``"token"`` weights ``rho_t = exp(log_ratio_t)``;
  ``"sequence"`` weights every token of row i with ``exp(sum_t log_ratio_t)``. Exponents are clamped
  to +-20 (``SAFETY_BOUND``). The threshold is either one upper bound (truncated IS: weights clamped
  to it) or ``"lower_upper"`` (IcePop: weights outside ``[lower, upper]`` become 0). Optionally
  normalised to mean 1 over the batch. Weights are constants (no gradient).
* **Rejection sampling** (``rollout_rs``): a comma-separated list of criteria, each a divergence
  ``k1 = -log_ratio``, ``k2 = log_ratio**2 / 2`` or ``k3 = exp(log_ratio) - 1 - log_ratio`` taken per
  token (``token_k*``) or per row as a sum, mean or max (``seq_sum_k*``, ``seq_mean_k*``,
  ``seq_max_k2/3``). A token (or the whole row) whose statistic leaves its bound is dropped from the
  response mask; all criteria must pass. k1 criteria take ratio bounds ``"lower_upper"`` (compared in
  log space; a single value ``u`` means ``1/u_u``), the others one upper bound.
* **Diagnostics**: the off-policy metrics (KL between the two policies, k3 KL, perplexities and their
  ratio, chi-square) and per-criterion statistics, under verl's names (``rollout_corr/...``).

Metrics are returned as 0-dim tensors (no host sync here); the caller converts them once.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .aggregation import masked_mean, masked_sum
from .correction_specs import (IS_LEVELS, SAFETY_BOUND, RolloutCorrection, Threshold,
                               parse_is_threshold, parse_rs_options, parse_rs_thresholds)

Metrics = dict[str, torch.Tensor]


# ---------------------------------------------------------------------------------------------
# importance weights
# ---------------------------------------------------------------------------------------------


def _masked_max(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return x.masked_fill(~valid, float("-inf")).max()


def _masked_min(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return x.masked_fill(~valid, float("inf")).min()


def _clamped_std(x: torch.Tensor, valid: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """sqrt(E[x^2] - E[x]^2) of x clamped to [low, high] over valid tokens; 0 with < 2 tokens."""
    if int(valid.sum()) < 2:
        return torch.zeros((), dtype=x.dtype, device=x.device)
    clamped = x.clamp(min=low, max=high)
    mean = masked_mean(clamped, valid)
    return torch.sqrt(torch.clamp(masked_mean(clamped.square(), valid) - mean.square(), min=0.0))


def _std(x: torch.Tensor) -> torch.Tensor:
    """torch.std (n - 1) of a 1-D tensor, 0 for fewer than two entries."""
    return x.std() if x.numel() > 1 else torch.zeros((), dtype=x.dtype, device=x.device)


def importance_weights(log_ratio: torch.Tensor, response_mask: torch.Tensor, *, level: str,
                       threshold: Threshold, batch_normalize: bool = False) -> tuple[torch.Tensor, Metrics]:
    """(B, T) IS weights (0 at masked positions, detached) and their metrics (``rollout_is_*``).

    ``level`` "token": ``exp(clamp(log_ratio))``; "sequence": ``exp(clamp(sum_t log_ratio))`` on every
    token of the row. Truncated to ``threshold``'s upper bound, or zeroed outside ``[lower, upper]``
    (IcePop). ``batch_normalize`` divides by the weights' mean (over tokens, or over rows for
    "sequence") when it is above 1e-8."""
    if level not in IS_LEVELS:
        raise ValueError(f"rollout_is must be one of {IS_LEVELS} (or null), got {level!r}")
    upper, lower = parse_is_threshold(threshold)
    valid = response_mask != 0
    mask = valid.to(log_ratio.dtype)
    if level == "token":
        stat_log = log_ratio
        raw = torch.exp(torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    else:
        stat_log = masked_sum(log_ratio, valid, dim=-1).unsqueeze(-1)  # (B, 1)
        raw = torch.exp(torch.clamp(stat_log, -SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    raw = raw * mask
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    metrics = _is_metrics(weights, raw, stat_log, valid, level, upper, lower)
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = masked_mean(((raw < lower) | (raw > upper)).to(raw.dtype), valid)
    weights = weights.detach()
    if batch_normalize:
        if level == "token":
            mean = masked_mean(weights, valid)
        else:
            alive = valid.any(dim=-1).to(weights.dtype)
            mean = (masked_mean(weights, valid, dim=-1) * alive).sum() / alive.sum().clamp(min=1e-8)
        if float(mean) > 1e-8:
            weights = weights / mean
            metrics["rollout_is_batch_norm_factor"] = mean
        else:
            metrics["rollout_is_batch_norm_factor"] = torch.ones((), dtype=weights.dtype)
    return weights, metrics


def _is_metrics(weights: torch.Tensor, raw: torch.Tensor, stat_log: torch.Tensor, valid: torch.Tensor,
                level: str, upper: float, lower: Optional[float]) -> Metrics:
    """Statistics of the applied weights; how often the raw ratios leave the bounds (the lower bound
    defaults to 1 / upper for these fractions)."""
    low = 1.0 / upper if lower is None else lower
    m: Metrics = {"rollout_is_mean": masked_mean(weights, valid)}
    if level == "sequence":
        m["rollout_is_max"] = torch.exp(torch.clamp(stat_log.max(), max=SAFETY_BOUND))
        m["rollout_is_min"] = torch.exp(stat_log.min())
        m["rollout_is_ratio_fraction_high"] = (stat_log > math.log(upper)).to(weights.dtype).mean()
        m["rollout_is_ratio_fraction_low"] = (stat_log < math.log(low)).to(weights.dtype).mean()
    else:
        m["rollout_is_ratio_fraction_high"] = masked_mean((raw > upper).to(weights.dtype), valid)
        m["rollout_is_ratio_fraction_low"] = masked_mean((raw < low).to(weights.dtype), valid)
        m["rollout_is_max"] = _masked_max(weights, valid)
        m["rollout_is_min"] = _masked_min(weights, valid)
    m["rollout_is_std"] = _clamped_std(weights, valid, 0.0, upper)
    bounded = weights.clamp(min=0.0, max=upper)
    normalised = bounded / (masked_mean(bounded, valid) + 1e-8)
    second_moment = masked_mean(normalised.square(), valid)
    # Every weight 0 (IcePop cut them all): no effective sample. verl divides by zero there and the
    # step fails (ZeroDivisionError); docs/verl.md names the difference.
    m["rollout_is_eff_sample_size"] = torch.where(second_moment > 0, 1.0 / second_moment,
                                                  torch.zeros_like(second_moment))
    row_means = masked_mean(weights, valid, dim=-1)
    m["rollout_is_seq_mean"] = row_means.mean()
    m["rollout_is_seq_std"] = _std(row_means)
    m["rollout_is_seq_max"] = row_means.max()
    m["rollout_is_seq_min"] = row_means.min()
    m["rollout_is_seq_max_deviation"] = (row_means - 1.0).abs().max()
    raw_row_means = masked_mean(raw, valid, dim=-1)
    m["rollout_is_seq_fraction_high"] = (raw_row_means > upper).to(weights.dtype).mean()
    m["rollout_is_seq_fraction_low"] = (raw_row_means < low).to(weights.dtype).mean()
    return m


# ---------------------------------------------------------------------------------------------
# rejection sampling
# ---------------------------------------------------------------------------------------------


def _divergences(log_ratio: torch.Tensor) -> dict[str, torch.Tensor]:
    safe = torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    return {"k1": -safe, "k2": 0.5 * safe.square(), "k3": torch.exp(safe) - 1.0 - safe}


def _row_statistic(kind: str, token_stat: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    if kind == "sum":
        return masked_sum(token_stat, valid, dim=-1)
    if kind == "mean":
        return masked_mean(token_stat, valid, dim=-1)
    row_max = token_stat.masked_fill(~valid, float("-inf")).max(dim=-1).values
    return torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)


def rejection_mask(log_ratio: torch.Tensor, response_mask: torch.Tensor, *, rollout_rs: str,
                   threshold: Threshold) -> tuple[torch.Tensor, Metrics]:
    """The response mask with rejected tokens (or rows) set to 0, in ``response_mask``'s dtype, and the
    ``rollout_rs_*`` metrics. Every criterion of ``rollout_rs`` must pass for a token to stay."""
    options = parse_rs_options(rollout_rs)
    bounds = parse_rs_thresholds(options, threshold)
    if log_ratio.shape[0] == 0:
        return response_mask, {}
    valid = response_mask != 0
    alive = valid.any(dim=-1)
    divergences = _divergences(log_ratio)
    keep_all = torch.ones_like(log_ratio)
    metrics: Metrics = {}
    for option in options:
        lower, upper = bounds[option]
        scope, _, kind = option.rpartition("_")  # "token", "seq_sum", "seq_mean", "seq_max"
        token_stat = divergences[kind]
        if kind == "k1":
            low_cut, high_cut = math.log(lower), math.log(upper)
        else:
            low_cut, high_cut = 0.0, upper
        if scope == "token":
            stat, row_stat = token_stat, None
        else:
            row_stat = _row_statistic(scope.split("_")[1], token_stat, valid)
            stat = row_stat.unsqueeze(-1).expand_as(log_ratio)
        keep = stat <= high_cut
        if kind == "k1":
            keep = keep & (stat >= low_cut)
        keep_float = keep.to(log_ratio.dtype)
        keep_all = keep_all * keep_float
        metrics.update(_rs_metrics(option, stat, row_stat, valid, alive, high_cut, low_cut, kind == "k1"))
        row_kept = ~((~keep) & valid).any(dim=-1)
        metrics[f"rollout_rs_{option}_masked_fraction"] = masked_mean(1 - keep_float, valid)
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = (
            ((~row_kept) & alive).to(log_ratio.dtype).sum() / alive.sum() if bool(alive.any())
            else torch.zeros((), dtype=log_ratio.dtype))
    metrics["rollout_rs_masked_fraction"] = masked_mean(1 - keep_all, valid)
    rejected_somewhere = (~((keep_all > 0.5) & valid) & valid).any(dim=-1)
    metrics["rollout_rs_seq_masked_fraction"] = rejected_somewhere.to(log_ratio.dtype).mean()
    return (response_mask * keep_all).to(response_mask.dtype), metrics


def _rs_metrics(option: str, stat: torch.Tensor, row_stat: Optional[torch.Tensor], valid: torch.Tensor,
                alive: torch.Tensor, high: float, low: float, two_sided: bool) -> Metrics:
    """Per-criterion statistics: mean over tokens, max / min (over rows for a row criterion), the
    share beyond each bound, the clamped std, and row-level summaries."""
    p = f"rollout_rs_{option}"
    dtype = stat.dtype
    rows = (masked_mean(stat, valid, dim=-1) if row_stat is None else row_stat)[alive]
    m: Metrics = {f"{p}_mean": masked_mean(stat, valid)}
    sequence_level = row_stat is not None and rows.numel() > 0
    if sequence_level:
        m[f"{p}_max"], m[f"{p}_min"] = rows.max(), rows.min()
        m[f"{p}_fraction_high"] = (rows > high).to(dtype).mean()
        m[f"{p}_fraction_low"] = (rows < low).to(dtype).mean() if two_sided else torch.zeros((), dtype=dtype)
    else:
        m[f"{p}_max"], m[f"{p}_min"] = _masked_max(stat, valid), _masked_min(stat, valid)
        m[f"{p}_fraction_high"] = masked_mean((stat > high).to(dtype), valid)
        m[f"{p}_fraction_low"] = (masked_mean((stat < low).to(dtype), valid) if two_sided
                                  else torch.zeros((), dtype=dtype))
    m[f"{p}_std"] = _clamped_std(stat, valid, low if two_sided else 0.0, high)
    zero = torch.zeros((), dtype=dtype)
    if rows.numel() > 0:
        m[f"{p}_seq_mean"], m[f"{p}_seq_std"] = rows.mean(), _std(rows)
        m[f"{p}_seq_max"], m[f"{p}_seq_min"] = rows.max(), rows.min()
        m[f"{p}_seq_max_deviation"] = rows.abs().max()
        m[f"{p}_seq_fraction_high"] = (rows > high).to(dtype).mean()
        if two_sided:
            m[f"{p}_seq_fraction_low"] = (rows < low).to(dtype).mean()
    else:
        for name in ("seq_mean", "seq_std", "seq_max", "seq_min", "seq_max_deviation", "seq_fraction_high",
                     "seq_fraction_low"):
            m[f"{p}_{name}"] = zero
    return m


# ---------------------------------------------------------------------------------------------
# diagnostics and the whole step
# ---------------------------------------------------------------------------------------------


def offpolicy_metrics(old_log_prob: torch.Tensor, rollout_log_prob: Optional[torch.Tensor],
                      response_mask: torch.Tensor) -> Metrics:
    """How far the trainer's policy (``old_log_prob``) is from the rollout's, per token and per row:
    ``kl`` = mean of log pi_rollout - log pi_train (KL(rollout || train)), ``k3_kl``, both
    perplexities (mean over rows of exp(-mean log-prob)), ``log_ppl_diff`` (+abs, max, min),
    ``ppl_ratio`` and the chi-square divergences E[rho^2] - 1 per token and per row."""
    valid = response_mask != 0
    train_row = masked_mean(old_log_prob, valid, dim=-1)
    m: Metrics = {"training_ppl": torch.exp(-train_row).mean(), "training_log_ppl": (-train_row).mean()}
    if rollout_log_prob is None:
        return m
    log_ratio = old_log_prob - rollout_log_prob
    m["kl"] = masked_mean(rollout_log_prob - old_log_prob, valid)
    m["k3_kl"] = masked_mean(torch.exp(log_ratio) - log_ratio - 1, valid)
    rollout_row = masked_mean(rollout_log_prob, valid, dim=-1)
    m["rollout_ppl"] = torch.exp(-rollout_row).mean()
    m["rollout_log_ppl"] = (-rollout_row).mean()
    diff = rollout_row - train_row
    m["log_ppl_diff"], m["log_ppl_abs_diff"] = diff.mean(), diff.abs().mean()
    m["log_ppl_diff_max"], m["log_ppl_diff_min"] = diff.max(), diff.min()
    m["ppl_ratio"] = torch.exp(diff).mean()
    rho = torch.exp(torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    m["chi2_token"] = masked_mean(rho.square(), valid) - 1.0
    row_sum = torch.clamp(masked_sum(log_ratio, valid, dim=-1), -SAFETY_BOUND, SAFETY_BOUND)
    m["chi2_seq"] = torch.exp(2.0 * row_sum).mean() - 1.0
    return m


def correct_rollout(*, old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                    settings: RolloutCorrection) -> tuple[Optional[torch.Tensor], torch.Tensor, Metrics]:
    """``(weights or None, response mask after rejection, metrics)`` for one batch: verl's decoupled
    mode, where ``old_log_prob`` is the trainer's recomputation of the sampling policy. Metrics carry
    verl's ``rollout_corr/`` prefix. Needs at least one valid token."""
    valid = response_mask != 0
    if not bool(valid.any()):
        raise ValueError("rollout correction needs at least one valid response token")
    if old_log_prob.shape != rollout_log_prob.shape or old_log_prob.shape != response_mask.shape:
        raise ValueError(f"log-prob and mask shapes differ: {tuple(old_log_prob.shape)}, "
                         f"{tuple(rollout_log_prob.shape)}, {tuple(response_mask.shape)}")
    log_ratio = old_log_prob - rollout_log_prob
    metrics: Metrics = {}
    weights = None
    if settings.rollout_is is not None and settings.rollout_is_threshold is not None:
        weights, is_metrics = importance_weights(log_ratio, response_mask, level=settings.rollout_is,
                                                 threshold=settings.rollout_is_threshold,
                                                 batch_normalize=settings.rollout_is_batch_normalize)
        metrics.update(is_metrics)
    mask = response_mask.clone()
    if settings.rollout_rs is not None:
        mask, rs_metrics = rejection_mask(log_ratio, response_mask, rollout_rs=settings.rollout_rs,
                                          threshold=settings.rollout_rs_threshold)
        metrics.update(rs_metrics)
    metrics.update(offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask))
    return weights, mask, {f"rollout_corr/{k}": v for k, v in metrics.items()}
