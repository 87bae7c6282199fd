"""PPO / RLHF algorithm core: pure torch functions on (B, T) tensors.

No configs, no distributed or orchestration imports: every function takes keyword arguments
and tensors shaped (B, T) = (rows, response tokens) with masks where 1 marks a counted token.
Micro-batch and data-parallel loss scaling is documented once, in ``aggregation``.
"""

from .advantage import compute_gae, compute_gae_reference, discounted_reverse_cumsum
from .aggregation import agg_loss, global_counts, masked_mean, masked_sum, masked_var, masked_whiten
from .controllers import (
    AdaptiveKLController,
    FixedKLController,
    kl_controller_from_state,
    make_kl_controller,
)
from .kl import apply_kl_penalty, get_kl_estimator, kl_estimator_names, kl_penalty
from .logits import entropy_from_logits, logprobs_from_logits
from .loss_modes import (
    compute_policy_loss_clip_cov,
    compute_policy_loss_geo_mean,
    compute_policy_loss_gpg,
    compute_policy_loss_gspo,
    compute_policy_loss_kl_cov,
)
from .losses import compute_policy_loss, compute_value_loss
from .outcome import (
    compute_gpg_advantage,
    compute_grpo_advantage,
    compute_grpo_passk_advantage,
    compute_opo_advantage,
    compute_reinforce_plus_plus_advantage,
    compute_reinforce_plus_plus_baseline_advantage,
    compute_remax_advantage,
    compute_rloo_advantage,
)
from .registry import (
    ADV_ESTIMATORS,
    AGG_MODES,
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    Registry,
    accepted_kwargs,
    estimator_takes,
    get_adv_estimator,
    get_agg_fn,
    get_kl_controller_cls,
    get_policy_loss_fn,
    register_adv_estimator,
    register_agg_mode,
    register_kl_controller,
    register_kl_estimator,
    register_policy_loss,
)

__all__ = [
    "ADV_ESTIMATORS",
    "AGG_MODES",
    "AdaptiveKLController",
    "FixedKLController",
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "Registry",
    "accepted_kwargs",
    "estimator_takes",
    "agg_loss",
    "apply_kl_penalty",
    "compute_gae",
    "compute_gae_reference",
    "compute_gpg_advantage",
    "compute_grpo_advantage",
    "compute_grpo_passk_advantage",
    "compute_opo_advantage",
    "compute_policy_loss",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_gpg",
    "compute_policy_loss_gspo",
    "compute_policy_loss_kl_cov",
    "compute_reinforce_plus_plus_advantage",
    "compute_reinforce_plus_plus_baseline_advantage",
    "compute_remax_advantage",
    "compute_rloo_advantage",
    "compute_value_loss",
    "discounted_reverse_cumsum",
    "entropy_from_logits",
    "get_adv_estimator",
    "get_agg_fn",
    "get_kl_controller_cls",
    "get_kl_estimator",
    "get_policy_loss_fn",
    "global_counts",
    "kl_controller_from_state",
    "kl_estimator_names",
    "kl_penalty",
    "logprobs_from_logits",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "register_adv_estimator",
    "register_agg_mode",
    "register_kl_controller",
    "register_kl_estimator",
    "register_policy_loss",
]
