"""The narrow settings the stages hand to the layers below them, each built once from the config
here: what is below the stages takes the few values it reads, never the whole ``RLHFConfig``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from rlhf_core.config import RLHFConfig
from rlhf_core.config.machine import cuda_devices
from rlhf_core.config.resolve import frozen_param_offload, micro_batching, role_model_key, update_world_size
from rlhf_core.paths import resolve_model_path
from rlhf_core.rewards.sequence import RewardModelSettings, RewardSettings
from rlhf_core.rollout.generate import GenerationSettings
from rlhf_core.run.models import reward_model_path
from rlhf_core.scoring.models import scoring_device, scoring_dtype
from rlhf_core.scoring.policy_kl import KLPassSettings
from rlhf_core.training.ds_config import resolve_device, role_dtype


def actor_dtype(cfg: RLHFConfig, device: Optional[str] = None) -> str:
    """The actor's training dtype on ``device`` (default: trainer.device), 'auto' resolved for its model
    (``ds_config.role_dtype``): rollout, scoring and the KL guard run in it."""
    # the dtype alone: the stages that run in it declare that key, not the actor's ZeRO or offload ones
    dtype = cfg.actor_rollout_ref.actor.deepspeed_config.dtype
    return role_dtype(dtype, role_model_key(cfg), device or resolve_device(cfg.trainer.device))


def kl_pass(cfg: RLHFConfig) -> KLPassSettings:
    """The KL guard's and validation's passes over the actor and the reference."""
    device = scoring_device(cfg.trainer.device)
    model = cfg.actor_rollout_ref.model
    return KLPassSettings(
        device=device, dtype=scoring_dtype(device, actor_dtype(cfg, device.type)),
        attention=model.override_config.attn_implementation, temperature=cfg.actor_rollout_ref.rollout.temperature,
        ref_budget=micro_batching(cfg, "ref").token_budget, ref_offload=frozen_param_offload(cfg, "ref"),
        actor_batching=micro_batching(cfg, "rollout"), packed=model.use_remove_padding)


def generation(cfg: RLHFConfig) -> GenerationSettings:
    """Rollout's and validation's generation: the engine runs at the actor's training dtype, so a
    vLLM engine's log-probs are the trainer's (vLLM's own "auto" would run an fp32 checkpoint at bf16)."""
    model = cfg.actor_rollout_ref.model
    dtype = actor_dtype(cfg)
    return GenerationSettings(
        rollout=cfg.actor_rollout_ref.rollout, data=cfg.data, device=cfg.trainer.device, dtype=dtype,
        attention=model.override_config.attn_implementation, tokenizer_path=model.tokenizer_path)


def reward_model_paths(cfg: RLHFConfig) -> tuple[Optional[Path], Optional[Path]]:
    """(reward model, its input tokenizer): (None, None) for rule-based rewards."""
    rm, rm_tokenizer = reward_model_path(cfg), None
    if rm is not None and cfg.reward_model.model.input_tokenizer:
        rm_tokenizer = resolve_model_path(cfg.reward_model.model.input_tokenizer)
    return rm, rm_tokenizer


def reward_settings(cfg: RLHFConfig) -> RewardSettings:
    """The rewards' settings; the reward model's keys only read when it scores."""
    rm, data, model = cfg.reward_model, cfg.data, None
    if rm.enable:
        model = RewardModelSettings(
            device=scoring_device(cfg.trainer.device),
            batching=micro_batching(cfg, "reward_model", update_world_size(cfg.trainer, cuda_devices())),
            offload=frozen_param_offload(cfg, "reward_model"),
            max_length=rm.max_length or data.max_prompt_length + data.max_response_length)
    return RewardSettings(reward_function=cfg.custom_reward_function, reward_fn_key=data.reward_fn_key,
                          overlong=rm.overlong_buffer, max_response_length=data.max_response_length,
                          reward_model=model)
