"""What the update reads of a config, built once per update or replay by the builders here, whose
parameters name the keys they read (``config.reads``): the keys the update hashes — its manifest's
config hash and every state id (``lineage.state_id``) — are ``update_keys``, read from these
signatures and written nowhere else.

    update_settings   the training loop: each role's loss, epochs, micro-batching, mini-batch, shuffle
    engine_settings   the actor's and critic's engines: dtype, DeepSpeed config, attention, optimizer
    update_world      the processes the update runs on (trainer.nproc, nnodes, n_gpus_per_node, device)
    run_length        the run's training steps, which a cosine or ratio warm-up lr schedule needs

The world size and the device the update runs on are the process's (keyword-only, given to
``build``): the world size is the group's, the device the one resolved from trainer.device.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Annotated, Any, Callable, Optional

import torch

from rlhf_core.config import RLHFConfig, resolve
from rlhf_core.config.errors import ConfigError
from rlhf_core.config.machine import cuda_devices
from rlhf_core.config.reads import ActorModel, AdvEstimator, At, Built, CriticEnable, TrainerDevice, config_keys
from rlhf_core.config.schema import ActorConfig, CriticConfig, DeepSpeedConfig, OptimConfig, RolloutCorrectionConfig
from rlhf_core.config.validate import role_deepspeed
from rlhf_core.models.attention import resolve_attention
from rlhf_core.training.batch import BUDGET_KEYS, MicroBatchPlan
from rlhf_core.training.ds_config import role_ds_config, role_dtype
from rlhf_core.training.engines import LoraSettings
from rlhf_core.training.ppo import ActorLoss, CriticLoss, RoleSettings

Actor = Annotated[ActorConfig, At("actor_rollout_ref.actor.")]
Critic = Annotated[CriticConfig, At("critic.")]
Seed = Annotated[int, At("trainer.seed")]


def critic_trains(critic_enable: CriticEnable, adv_estimator: AdvEstimator) -> bool:
    """Whether the update trains a critic (verl's need_critic: ``config.resolve.has_critic``)."""
    return resolve.has_critic(critic_enable, adv_estimator)


CriticTrains = Annotated[bool, Built(critic_trains)]


@dataclass(frozen=True)
class UpdateSettings:
    """What the training loop reads of a config (``update_settings``), so a value such as
    ``actor.clip_ratio`` has one path into training: schema → this builder → the loss."""

    actor: RoleSettings
    critic: Optional[RoleSettings]
    """None in a run without a critic (``critic_trains``)."""
    seed: int
    """trainer.seed: the mini-batch order's seed is "<seed>:<iteration>"."""
    critic_warmup: int
    concurrent_critic_actor: str
    """trainer.concurrent_critic_actor: the roles side by side or in turn (same numbers)."""
    lora: Optional[LoraSettings]
    """The actor's adapters (None: full fine-tuning), recorded in trainer_state.json."""
    learning_rates: tuple[float, float]
    """The actor's and the critic's base lr (``optim.lr``; a retry halves the actor's)."""

    def actor_updates(self, iteration: int) -> bool:
        """Whether training step ``iteration`` (1-based, verl's global_steps) updates the actor: verl's
        ``critic_warmup <= global_steps``, so critic_warmup=N trains only the critic in steps 1..N-1."""
        return self.critic_warmup <= iteration


def update_settings(actor: Actor, model: ActorModel, critic: Critic, critic_on: CriticTrains,
                    n: Annotated[int, At("actor_rollout_ref.rollout.n")],
                    temperature: Annotated[float, At("actor_rollout_ref.rollout.temperature")],
                    max_response_length: Annotated[int, At("data.max_response_length")],
                    correction: Annotated[RolloutCorrectionConfig, At("algorithm.rollout_correction.")],
                    seed: Seed, critic_warmup: Annotated[int, At("trainer.critic_warmup")],
                    concurrent_critic_actor: Annotated[str, At(
                        "trainer.concurrent_critic_actor",
                        unhashed="the roles train side by side or in turn, to the same numbers "
                                 "(tests/rlhf_core/stages/test_update_stage.py)")],
                    *, world_size: int) -> UpdateSettings:
    """``UpdateSettings`` on ``world_size`` ranks (the micro-batching divides by it): each role's loss,
    epochs, micro-batching, mini-batch and shuffle, as verl's critic.* keys fall back to the actor's
    (``config.resolve.update_values``)."""
    values = resolve.update_values(actor, model, critic, n=n, max_response_length=max_response_length,
                                   critic_on=critic_on, correction=correction, world_size=world_size)
    actor_role = _role_settings("actor", _actor_loss(actor, temperature, values), values.actor)
    critic_role = None if values.critic is None else _role_settings(
        "critic", CriticLoss(cliprange_value=critic.cliprange_value, loss_agg_mode=values.critic.loss_agg_mode,
                             loss_scale_factor=values.critic.loss_scale_factor), values.critic)
    return UpdateSettings(actor_role, critic_role, seed, critic_warmup, concurrent_critic_actor,
                          LoraSettings.from_config(model), (actor.optim.lr, critic.optim.lr))


def _role_settings(role: str, loss: Any, values: resolve.RoleUpdate) -> RoleSettings:
    mb = values.micro_batching
    plan = MicroBatchPlan(use_dynamic_bsz=mb.use_dynamic_bsz, token_budget=mb.token_budget,
                          micro_batch_size=mb.micro_batch_size, pack_rows=values.use_remove_padding,
                          budget_key=BUDGET_KEYS[role])
    return RoleSettings(loss, values.epochs, plan, values.mini_batch_sequences, values.shuffle)


def _actor_loss(a: ActorConfig, temperature: float, values: resolve.UpdateValues) -> ActorLoss:
    low, high = a.clip_ratios  # the schema's fallback to clip_ratio, as verl's
    knobs = {f.name: getattr(a.policy_loss, f.name) for f in fields(a.policy_loss) if f.name != "loss_mode"}
    correction = values.rollout_correction
    return ActorLoss(
        clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=a.clip_ratio_c, loss_agg_mode=values.actor.loss_agg_mode,
        loss_mode=values.policy_loss_mode, entropy_coeff=a.entropy_coeff, use_kl_loss=a.use_kl_loss,
        kl_loss_coef=a.kl_loss_coef, kl_loss_type=a.kl_loss_type, temperature=temperature,
        loss_scale_factor=values.actor.loss_scale_factor,
        loss_mode_settings=tuple(sorted({**knobs, "tau_pos": a.tau_pos, "tau_neg": a.tau_neg}.items())),
        rollout_correction=correction if correction.bypass_mode else None)


@dataclass(frozen=True)
class RoleEngine:
    """What one role's engine is built from."""

    dtype: str
    """'fp32' | 'bf16' | 'fp16', resolved for the device and the model (``ds_config.role_dtype``)."""
    ds_config: dict[str, Any]
    """The DeepSpeed config (``ds_config.role_ds_config``)."""
    gradient_checkpointing: bool
    attention: str
    """The implementation scoring and the guard load with too (``models.attention.resolve_attention``):
    one kernel for the same data."""
    optim: OptimConfig


@dataclass(frozen=True)
class EngineSettings:
    """Everything the actor and critic engines are built from (``engine_settings``), and so what a
    resident trainer compares to decide whether its engines can be kept (``rank_update.engine_key``)."""

    device: str
    world_size: int
    actor: RoleEngine
    critic: Optional[RoleEngine]
    """None in a run without a critic (``critic_trains``)."""
    lora: Optional[LoraSettings]
    seed: int
    """Fresh LoRA adapters are initialised from it (trainer.seed)."""
    total_steps: int
    """The run's training steps, which an lr schedule may need (``RunLength.steps``)."""


def engine_settings(actor: Actor, model: ActorModel, critic: Critic, critic_on: CriticTrains, seed: Seed, *,
                    device: str, world_size: int, total_steps: int = 0) -> EngineSettings:
    """``EngineSettings`` on ``world_size`` ranks of ``device``: each trained role's DeepSpeed
    settings with verl's FSDP offload flags folded in, its dtype, attention and optimizer."""
    actor_engine = _role_engine(
        "actor_rollout_ref.actor", role_deepspeed(actor.deepspeed_config, actor.fsdp_config), actor.grad_clip,
        resolve.trained_model_key(model, critic, "actor"), model.enable_gradient_checkpointing,
        model.override_config.attn_implementation, actor.optim, device=device, world_size=world_size)
    critic_engine = None if not critic_on else _role_engine(
        "critic", role_deepspeed(critic.deepspeed_config, critic.model.fsdp_config), critic.grad_clip,
        resolve.trained_model_key(model, critic, "critic"), critic.model.enable_gradient_checkpointing,
        critic.model.override_config.attn_implementation, critic.optim, device=device, world_size=world_size)
    return EngineSettings(device, world_size, actor_engine, critic_engine, LoraSettings.from_config(model), seed,
                          total_steps)


def _role_engine(section: str, ds: DeepSpeedConfig, grad_clip: float, model_key: str, gradient_checkpointing: bool,
                 attention: str, optim: OptimConfig, *, device: str, world_size: int) -> RoleEngine:
    """One trained role's engine settings; ``section``: its config section, named in errors."""
    return RoleEngine(role_dtype(ds.dtype, model_key, device, section),
                      role_ds_config(ds, grad_clip=grad_clip, model_key=model_key, device=device,
                                     world_size=world_size, key=f"{section}.deepspeed_config"),
                      gradient_checkpointing, resolve_attention(attention, torch.device(device)), optim)


def update_world(nproc: Annotated[Optional[int], At("trainer.nproc")], nnodes: Annotated[int, At("trainer.nnodes")],
                 n_gpus_per_node: Annotated[Optional[int], At("trainer.n_gpus_per_node")],
                 device: TrainerDevice) -> int:
    """The update's processes, all nodes together, on this machine's devices
    (``config.resolve.processes_per_node``): the data-parallel world its numbers are summed over."""
    nodes, per_node = resolve.processes_per_node(nproc, nnodes, n_gpus_per_node,
                                                 cuda_devices() if device != "cpu" else 0)
    return nodes * per_node


def needs_total_steps(optim: OptimConfig) -> bool:
    """Whether ``optim``'s lr schedule depends on the run's length (cosine decay, or a warm-up ratio)."""
    return resolve.scheduler_type(optim) == "cosine" or (optim.lr_warmup_steps < 0 and optim.lr_warmup_steps_ratio > 0)


def schedule_needs_total_steps(actor_optim: Annotated[OptimConfig, At("actor_rollout_ref.actor.optim.")],
                               critic_optim: Annotated[OptimConfig, At("critic.optim.")]) -> bool:
    """Whether an lr schedule of the update depends on the run's length."""
    return needs_total_steps(actor_optim) or needs_total_steps(critic_optim)


@dataclass(frozen=True)
class StepKeys:
    total_iterations: Optional[int]
    total_training_steps: Optional[int]
    total_epochs: int


def step_keys(total_iterations: Annotated[Optional[int], At("trainer.total_iterations")],
              total_training_steps: Annotated[Optional[int], At("trainer.total_training_steps")],
              total_epochs: Annotated[int, At("trainer.total_epochs")]) -> StepKeys:
    """The keys the run's length is read from (``config.resolve.run_steps``)."""
    return StepKeys(total_iterations, total_training_steps, total_epochs)


@dataclass(frozen=True)
class RunLength:
    """The run's training steps as the lr schedules need them (``run_length``)."""

    prompts_per_step: int
    """data.train_batch_size: a step's prompts, which divide an epoch's."""
    keys: Optional[StepKeys]
    """None: no lr schedule depends on the run's length, and it is not read."""

    def steps(self, count_prompts: Callable[[], Optional[int]]) -> int:
        """The run's training steps; 0 when no schedule needs them. ``count_prompts``: the prompts in
        the run's prompts/train.parquet (None: not there yet), asked only when neither
        trainer.total_iterations nor trainer.total_training_steps gives the count."""
        k = self.keys
        if k is None:
            return 0
        if k.total_iterations is not None or k.total_training_steps is not None:
            return resolve.run_steps(k.total_iterations, k.total_training_steps, k.total_epochs,
                                     self.prompts_per_step, 0)
        prompts = count_prompts()
        if prompts is None:
            raise ConfigError("the lr schedule (cosine, or lr_warmup_steps_ratio) needs the run's training steps: set "
                              "trainer.total_iterations (or trainer.total_training_steps), or run preprocess so "
                              "prompts/train.parquet can be counted")
        return resolve.run_steps(None, None, k.total_epochs, self.prompts_per_step, prompts)


def run_length(prompts_per_step: Annotated[int, At("data.train_batch_size")],
               keys: Annotated[Optional[StepKeys], Built(step_keys, when=schedule_needs_total_steps)]) -> RunLength:
    """How long the run trains, read only when an lr schedule needs it (the flow fills in
    trainer.total_iterations when a run starts; a single stage counts the run's prompts)."""
    return RunLength(prompts_per_step, keys)


def update_keys(cfg: RLHFConfig) -> tuple[str, ...]:
    """The config keys the update hashes: every key its builders read (``config.reads.config_keys``)."""
    return config_keys(update_settings, engine_settings, update_world, run_length, cfg=cfg)

