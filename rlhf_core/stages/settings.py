"""The narrow settings the stages hand to the layers below them, each built once from the config
here: what is below the stages takes the few values it reads, never the whole ``RLHFConfig``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

from rlhf_core.config import RLHFConfig
from rlhf_core.config.machine import cuda_devices
from rlhf_core.config.reads import ActorDtype, ActorModel, At, Built, Data, Rollout, RunDevice, TrainerDevice
from rlhf_core.config.resolve import log_prob_batching, param_offload, reward_model_batching, update_world_size
from rlhf_core.config.schema import CustomRewardConfig, RefConfig, RewardModelConfig, TrainerConfig
from rlhf_core.paths import resolve_model_path
from rlhf_core.rewards.sequence import RewardModelSettings, RewardSettings
from rlhf_core.rollout.generate import GenerationSettings
from rlhf_core.run.models import reward_model_path
from rlhf_core.scoring.models import scoring_device, scoring_dtype
from rlhf_core.scoring.policy_kl import KLPassSettings
from rlhf_core.training.ds_config import resolve_device, role_dtype


UPDATE_WORLD = ("the update's processes, which a global micro-batch size divides by: how the passes are cut, "
                "not what they compute (tests/rlhf_core/stages/test_score_stage.py: equal on 1, 2 and 4)")
"""Why the trainer section is read but not hashed by a stage that scores."""


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


def scores_with_a_model(enable: Annotated[bool, At("reward_model.enable")]) -> bool:
    return enable


def reward_model_settings(
        reward_model: Annotated[RewardModelConfig, At("reward_model.")], data: Data, device: RunDevice,
        critic_dynamic: Annotated[Optional[bool], At("critic.use_dynamic_bsz")],
        actor_dynamic: Annotated[bool, At("actor_rollout_ref.actor.use_dynamic_bsz")],
        critic_forward_budget: Annotated[Optional[int], At("critic.forward_max_token_len_per_gpu")],
        critic_budget: Annotated[int, At("critic.ppo_max_token_len_per_gpu")],
        trainer: Annotated[TrainerConfig, At("trainer.", unhashed=UPDATE_WORLD)]) -> RewardModelSettings:
    """The reward model's forwards: its micro-batches fall back to the critic's keys as verl's
    (``resolve.reward_model_batching``), for the update's world."""
    world = update_world_size(trainer, cuda_devices())
    return RewardModelSettings(
        device=scoring_device(device), offload=param_offload(reward_model.model.fsdp_config),
        batching=reward_model_batching(reward_model, critic_dynamic, actor_dynamic, critic_forward_budget,
                                       critic_budget, world),
        max_length=reward_model.max_length or data.max_prompt_length + data.max_response_length)


def reward_settings(reward_function: Annotated[CustomRewardConfig, At("custom_reward_function.")],
                    reward_model: Annotated[RewardModelConfig, At("reward_model.")], data: Data,
                    model: Annotated[Optional[RewardModelSettings], Built(reward_model_settings,
                                                                          when=scores_with_a_model)]) -> RewardSettings:
    """The rewards' settings (``build(reward_settings, cfg)``); the reward model's batching keys only
    read when it scores."""
    return RewardSettings(reward_function=reward_function, reward_fn_key=data.reward_fn_key,
                          overlong=reward_model.overlong_buffer, max_response_length=data.max_response_length,
                          reward_model=model)
