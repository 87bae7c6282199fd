"""The narrow settings the stages hand to the layers below them, each built once from the config
here: what is below the stages takes the few values it reads, never the whole ``RLHFConfig``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

from rlhf_core.config import RLHFConfig
from rlhf_core.config.machine import cuda_devices
from rlhf_core.config.reads import ActorDtype, ActorModel, At, Data, Rollout, RunDevice, TrainerDevice
from rlhf_core.config.resolve import (frozen_param_offload, log_prob_batching, micro_batching, param_offload,
                                      update_world_size)
from rlhf_core.config.schema import RefConfig
from rlhf_core.paths import resolve_model_path
from rlhf_core.rewards.sequence import RewardModelSettings, RewardSettings
from rlhf_core.rollout.generate import GenerationSettings
from rlhf_core.run.models import reward_model_path
from rlhf_core.scoring.models import scoring_device, scoring_dtype
from rlhf_core.scoring.policy_kl import KLPassSettings
from rlhf_core.training.ds_config import resolve_device, role_dtype


def kl_pass(device: TrainerDevice, dtype: ActorDtype, model: ActorModel,
            temperature: Annotated[float, At("actor_rollout_ref.rollout.temperature")],
            ref: Annotated[RefConfig, At("actor_rollout_ref.ref.")],
            log_prob_dynamic: Annotated[Optional[bool], At("actor_rollout_ref.rollout.log_prob_use_dynamic_bsz")],
            log_prob_budget: Annotated[Optional[int], At("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu")],
            log_prob_micro: Annotated[Optional[int], At("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu")],
            log_prob_micro_global: Annotated[Optional[int], At("actor_rollout_ref.rollout.log_prob_micro_batch_size")],
            actor_dynamic: Annotated[bool, At("actor_rollout_ref.actor.use_dynamic_bsz")],
            actor_budget: Annotated[int, At("actor_rollout_ref.actor.ppo_max_token_len_per_gpu")]) -> KLPassSettings:
    """The KL guard's and validation's passes over the actor and the reference (``build(kl_pass, cfg)``):
    the reference's budget and the actor-only pass's micro-batches fall back to the actor's as verl's
    (``resolve.log_prob_batching``); the dtype is the actor's training dtype on the scoring device."""
    scoring = scoring_device(device)
    ref_batching = log_prob_batching(ref.log_prob_use_dynamic_bsz, ref.log_prob_max_token_len_per_gpu,
                                     ref.log_prob_micro_batch_size_per_gpu, ref.log_prob_micro_batch_size,
                                     actor_dynamic, actor_budget)
    return KLPassSettings(
        device=scoring, dtype=scoring_dtype(scoring, role_dtype(dtype, model.path, scoring.type)),
        attention=model.override_config.attn_implementation, temperature=temperature,
        ref_budget=ref_batching.token_budget, ref_offload=param_offload(ref.fsdp_config),
        actor_batching=log_prob_batching(log_prob_dynamic, log_prob_budget, log_prob_micro, log_prob_micro_global,
                                         actor_dynamic, actor_budget),
        packed=model.use_remove_padding)


def generation(rollout: Rollout, data: Data, model: ActorModel, dtype: ActorDtype,
               device: RunDevice) -> GenerationSettings:
    """Rollout's and validation's generation (``build(generation, cfg)``): the engine runs at the actor's
    training dtype, so a vLLM engine's log-probs are the trainer's (vLLM's own "auto" would run an fp32
    checkpoint at bf16)."""
    return GenerationSettings(
        rollout=rollout, data=data, device=device, dtype=role_dtype(dtype, model.path, resolve_device(device)),
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
