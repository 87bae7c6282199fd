"""PPO actor and critic losses (Schulman et al. 2017, https://arxiv.org/abs/1707.06347).

Both return ``(loss, metrics)``: ``loss`` a 0-dim tensor aggregated by ``agg_loss`` (see
``aggregation`` for ``global_num_tokens`` / ``global_num_seqs``), ``metrics`` a dict of
detached 0-dim tensors that are plain means over this call's valid tokens (they are for
logging, so they are never rescaled to a global share). Keeping them as tensors means no
device->host sync inside the loss; the caller converts once per step.
"""

from __future__ import annotations

from typing import Optional

import torch

from .aggregation import Count, agg_loss, masked_mean
from .registry import register_policy_loss


@register_policy_loss("vanilla")
def compute_policy_loss(
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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate with dual clip (Ye et al. 2020, https://arxiv.org/abs/1912.09729).

    All tensors (B, T). With ratio rho = exp(clamp(log_prob - old_log_prob, -20, 20)):

        L1 = -A * rho,  L2 = -A * clip(rho, 1 - clip_ratio_low, 1 + clip_ratio_high)
        Lclip = max(L1, L2)
        L = min(Lclip, -A * clip_ratio_c)  if A < 0   else Lclip

    The dual clip caps the loss of a negative-advantage token at ``c * |A|`` so one token whose
    ratio exploded cannot dominate the update. ``rollout_is_weights`` (B, T), when given, multiply L
    per token (rollout correction's importance weights, constants). Metrics: ``pg_clipfrac`` (valid tokens with
    L2 > L1), ``pg_clipfrac_lower`` (valid tokens with A < 0 and Lclip > -A * c, i.e. the
    dual-clip bound active), ``ppo_kl`` (mean of old_log_prob - log_prob, clamped as above).
    """
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO, got {clip_ratio_c}")
    valid = response_mask != 0
    # Zero padding inputs up front: with inf/nan there, 0 * inf in the backward of the
    # excluded terms would still put nan into the gradient of the valid tokens' model.
    advantages = torch.where(valid, advantages, torch.zeros_like(advantages))
    log_ratio = torch.where(valid, log_prob - old_log_prob, torch.zeros_like(log_prob))
    negative_approx_kl = torch.clamp(log_ratio, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    loss_clip = torch.maximum(loss_unclipped, loss_clipped)
    loss_dual = -advantages * clip_ratio_c
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(loss_clip, loss_dual), loss_clip)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * torch.where(valid, rollout_is_weights.detach(), torch.zeros_like(pg_losses))
    loss = agg_loss(
        loss_mat=pg_losses,
        loss_mask=response_mask,
        loss_agg_mode=loss_agg_mode,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        loss_scale_factor=loss_scale_factor,
    )
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).float(), response_mask),
            "pg_clipfrac_lower": masked_mean((negative & (loss_clip > loss_dual)).float(), response_mask),
            "ppo_kl": masked_mean(-negative_approx_kl, response_mask),
        }
    return loss, metrics


def compute_value_loss(
    *,
    vpreds: torch.Tensor,
    values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float = 0.5,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: Optional[Count] = None,
    global_num_seqs: Optional[Count] = None,
    loss_scale_factor: Optional[Count] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss: ``0.5 * agg(max((v - R)^2, (clip(v, v_old - eps, v_old + eps) - R)^2))``.

    ``vpreds`` are the critic's current predictions, ``values`` the old predictions recorded
    at rollout, ``returns`` the GAE targets R; all (B, T); eps = ``cliprange_value``. Taking
    the max makes the clip pessimistic: it only ever removes the incentive to move v far from
    v_old. Metric ``vf_clipfrac``: valid tokens where the clipped term is strictly larger.
    """
    valid = response_mask != 0
    # See compute_policy_loss: keep padding garbage out of the backward pass.
    vpreds, values, returns = (torch.where(valid, x, torch.zeros_like(x)) for x in (vpreds, values, returns))
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    loss_unclipped = (vpreds - returns).square()
    loss_clipped = (vpred_clipped - returns).square()
    loss = 0.5 * agg_loss(
        loss_mat=torch.maximum(loss_unclipped, loss_clipped),
        loss_mask=response_mask,
        loss_agg_mode=loss_agg_mode,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        loss_scale_factor=loss_scale_factor,
    )
    with torch.no_grad():
        metrics = {"vf_clipfrac": masked_mean((loss_clipped > loss_unclipped).float(), response_mask)}
    return loss, metrics
