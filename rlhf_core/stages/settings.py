"""The narrow settings the stages hand to the layers below them, each built once from the config
here: what is below the stages takes the few values it reads, never the whole ``RLHFConfig``."""

from __future__ import annotations

from rlhf_core.config import RLHFConfig
from rlhf_core.config.resolve import frozen_param_offload, micro_batching
from rlhf_core.rollout.generate import GenerationSettings
from rlhf_core.scoring.models import scoring_device, scoring_dtype
from rlhf_core.scoring.policy_kl import KLPassSettings
from rlhf_core.training.ds_config import resolve_device, resolve_dtype


def kl_pass(cfg: RLHFConfig) -> KLPassSettings:
    """The KL guard's and validation's passes over the actor and the reference."""
    device = scoring_device(cfg.trainer.device)
    model = cfg.actor_rollout_ref.model
    return KLPassSettings(
        device=device, dtype=scoring_dtype(device, cfg.actor_rollout_ref.actor.deepspeed_config.dtype),
        attention=model.override_config.attn_implementation, temperature=cfg.actor_rollout_ref.rollout.temperature,
        ref_budget=micro_batching(cfg, "ref").token_budget, ref_offload=frozen_param_offload(cfg, "ref"),
        actor_batching=micro_batching(cfg, "rollout"), packed=model.use_remove_padding)


def generation(cfg: RLHFConfig) -> GenerationSettings:
    """Rollout's and validation's generation: the engine runs at the actor's training dtype, so a
    vLLM engine's log-probs are the trainer's (vLLM's own "auto" would run an fp32 checkpoint at bf16)."""
    model = cfg.actor_rollout_ref.model
    # the raw dtype key: the FSDP flags effective_deepspeed folds in move offload, never the dtype
    dtype = resolve_dtype(cfg.actor_rollout_ref.actor.deepspeed_config.dtype, resolve_device(cfg.trainer.device))
    return GenerationSettings(
        rollout=cfg.actor_rollout_ref.rollout, data=cfg.data, device=cfg.trainer.device, dtype=dtype,
        attention=model.override_config.attn_implementation, tokenizer_path=model.tokenizer_path)
