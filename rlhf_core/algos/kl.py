"""Per-token KL estimators between the policy and the reference policy, and the KL reward penalty.

All estimators see only the sampled token's log-probs (logprob under the policy that sampled,
ref_logprob under the reference), per J. Schulman, "Approximating KL Divergence" (2020),
http://joschu.net/blog/kl-approx.html. With log r = ref_logprob - logprob:

* ``k1`` / ``kl``: ``-log r``: unbiased, high variance, can be negative;
* ``abs``: ``|log r|``;
* ``k2`` / ``mse``: ``0.5 * (log r)**2``: biased, low variance; its gradient is the unbiased one;
* ``k3`` / ``low_var_kl``: ``r - 1 - log r``: unbiased, non-negative, low variance.

Each name with a ``+`` suffix (``k1+``, ``k3+``, ...) returns that estimator's value with k2's
gradient (straight-through), as verl does: the value stays an unbiased KL estimate while the
gradient is the correct one, which k1/k3 alone do not give.
"""

from __future__ import annotations

from typing import Callable, Union

import torch

from .aggregation import masked_mean
from .registry import KL_ESTIMATORS, register_kl_estimator

KLFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@register_kl_estimator("k1")
def _k1(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return logprob - ref_logprob


@register_kl_estimator("abs")
def _abs(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return (logprob - ref_logprob).abs()


@register_kl_estimator("k2")
def _k2(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logprob - ref_logprob).square()


@register_kl_estimator("k3")
def _k3(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    # k3 = r - 1 - log r from Schulman, "Approximating KL Divergence" (2020),
    # http://joschu.net/blog/kl-approx.html. Clamping log r to +-20 keeps exp finite in fp32/bf16;
    # clamping the result to +-10 bounds the penalty when the policies drift far apart (verl).
    log_ratio = torch.clamp(ref_logprob - logprob, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(log_ratio) - 1 - log_ratio, min=-10.0, max=10.0)


register_kl_estimator("kl")(_k1)
register_kl_estimator("mse")(_k2)
register_kl_estimator("low_var_kl")(_k3)


def _straight_through(base: KLFn) -> KLFn:
    def estimator(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
        value = base(logprob, ref_logprob)
        k2 = _k2(logprob, ref_logprob)
        # Forward: the base estimator's value. Backward: d k2 = (logprob - ref_logprob) d logprob,
        # whose expectation over on-policy samples is the gradient of KL(pi || ref); k1 and k3
        # as losses do not have that property (Schulman 2020, link above).
        return k2 + (value - k2).detach()

    return estimator


def kl_estimator_names() -> list[str]:
    base = KL_ESTIMATORS.names()
    return base + [name + "+" for name in base]


def get_kl_estimator(kind: str) -> KLFn:
    """Estimator ``fn(logprob, ref_logprob) -> tensor`` for ``kind`` (base name or ``name+``)."""
    if isinstance(kind, str) and kind.endswith("+") and kind[:-1] in KL_ESTIMATORS:
        return _straight_through(KL_ESTIMATORS.get(kind[:-1]))
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; valid: {kl_estimator_names()}")
    return KL_ESTIMATORS.get(kind)


def kl_penalty(*, logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Elementwise KL estimate, same shape as the inputs (see module docstring for ``kind``).

    ``logprob`` is the policy whose divergence is measured (the sampling policy when shaping
    rewards, the current policy in a KL loss); ``ref_logprob`` the reference policy.
    """
    return get_kl_estimator(kind)(logprob, ref_logprob)


def apply_kl_penalty(
    *,
    scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: Union[float, torch.Tensor],
    kind: str,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Turn sequence scores into KL-shaped token-level rewards.

    Args: ``scores`` (B,) sequence-level reward-model scores; ``old_log_prob``,
    ``ref_log_prob``, ``response_mask`` (B, T); ``kl_coef`` the KL coefficient beta;
    ``kind`` a KL estimator name.

    Returns ``(token_level_rewards, metrics)``: ``r_t = -beta * KL_t`` on valid tokens plus
    ``scores`` on each row's last valid token, 0 at masked positions except one: a row without valid
    tokens holds its score in the last column, where verl's reward manager writes an empty response's
    (at index length - 1 = -1), so the estimators that sum whole rows count it as verl's do.
    ``metrics["kl/mean"]`` is the mean over rows of the per-row token-mean KL, a row without valid
    tokens counting as 0 (verl's batch mean); ``metrics["kl/coef"]`` is beta. Both are 0-dim tensors.
    """
    with torch.no_grad():
        valid = response_mask != 0
        kl = kl_penalty(logprob=old_log_prob, ref_logprob=ref_log_prob, kind=kind)
        zero = torch.zeros((), dtype=kl.dtype, device=kl.device)
        # The last valid token is the only valid one with no valid token after it.
        valid_from_here = valid.flip(-1).long().cumsum(dim=-1).flip(-1)
        alive = valid.any(dim=-1)
        is_last = valid & (valid_from_here == 1)
        if is_last.shape[-1]:
            is_last[:, -1] |= ~alive
        placed = torch.where(is_last, scores.to(kl.dtype).unsqueeze(-1), zero)
        rewards = torch.where(valid, placed - kl_coef * kl, placed)
        row_kl = masked_mean(kl, valid, dim=-1)
        metrics = {
            "kl/mean": masked_mean(row_kl, torch.ones_like(alive)),
            "kl/coef": torch.as_tensor(kl_coef, dtype=kl.dtype, device=kl.device).detach().clone(),
        }
    return rewards, metrics

