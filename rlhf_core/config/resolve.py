"""Derived settings: values that default to another key's, resolved the way verl resolves them.

Every stage asks here instead of reading the raw field, so "null = the actor's" is decided once:

    mini_batch_sequences(cfg, "critic")       critic.ppo_mini_batch_size (or the actor's) × rollout.n
    micro_batching(cfg, "ref")                (use_dynamic_bsz, token budget, sequences per forward)
    update_values(actor, model, critic, ...)  every derived value of an update, in one call
    update_world_size(trainer, cuda_devices)  trainer.nproc, else n_gpus_per_node × nnodes
    update_nodes(trainer, cuda_devices)       (nnodes, processes per node) of that world
    ray_address(trainer, environ)       the Ray cluster of a multi-node update: trainer.ray_address, else $RAY_ADDRESS, else auto
    total_iterations(cfg, train_prompts)      trainer.total_iterations / total_training_steps / epochs
    uses_critic(cfg)                          critic.enable, else whether the estimator reads values
    needs_baseline_rollout(cfg)               the estimator takes reward_baselines (remax)
    frozen_param_offload(cfg, "ref")          the reference / reward model between passes in host memory

Nothing here reads files or the machine; callers pass what they measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping, Optional

from rlhf_core.algos.registry import estimator_takes
from rlhf_core.algos.correction_specs import RolloutCorrection
from rlhf_core.config.schema import (ActorConfig, ActorRolloutRefConfig, CriticConfig, FSDPConfig, ModelConfig,
                                     OptimConfig, RewardModelConfig, RLHFConfig, RolloutCorrectionConfig,
                                     TrainerConfig)

Role = Literal["actor", "critic", "rollout", "ref", "reward_model"]
"""actor/critic: the update's forward/backward; rollout: old log-probs; ref: reference log-probs;
reward_model: the reward model's forward."""


@dataclass(frozen=True)
class MicroBatching:
    use_dynamic_bsz: bool
    token_budget: int
    """Real tokens per micro-batch (per process) when use_dynamic_bsz."""
    micro_batch_size: int
    """Sequences per micro-batch (per process) without it."""


def uses_critic(cfg: RLHFConfig) -> bool:
    """verl's need_critic (``has_critic``) for this config."""
    return has_critic(cfg.critic.enable, cfg.algorithm.adv_estimator)


def has_critic(critic_enable: Optional[bool], adv_estimator: str) -> bool:
    """verl's need_critic: critic.enable when set, else whether algorithm.adv_estimator reads the
    critic's values (gae does; grpo, rloo, reinforce_plus_plus, ... do not)."""
    if critic_enable is not None:
        return bool(critic_enable)
    return estimator_takes(adv_estimator, "values")


def needs_baseline_rollout(cfg: RLHFConfig) -> bool:
    """Whether the estimator takes reward_baselines (remax): the rollout then also decodes one greedy
    response per prompt and the score stage scores it."""
    return estimator_takes(cfg.algorithm.adv_estimator, "reward_baselines")


def mini_batch_prompts(a: ActorConfig, c: CriticConfig, role: Literal["actor", "critic"]) -> int:
    """Prompts per optimizer step: the role's ppo_mini_batch_size (the critic's defaults to the actor's)."""
    if role == "critic" and c.ppo_mini_batch_size is not None:
        return c.ppo_mini_batch_size
    return a.ppo_mini_batch_size


def mini_batch_sequences(cfg: RLHFConfig, role: Literal["actor", "critic"]) -> int:
    """Sequences per optimizer step over all processes: prompts × rollout.n, as verl multiplies
    ppo_mini_batch_size by rollout.n before splitting it over the data-parallel ranks."""
    return mini_batch_prompts(cfg.actor_rollout_ref.actor, cfg.critic, role) * cfg.actor_rollout_ref.rollout.n


DEFAULT_MICRO_BATCH = 8
"""Sequences per forward when neither the per-GPU nor the global micro-batch size is set. verl has no
default there and refuses to start; a bare config runs here (docs/verl.md lists the difference)."""


def per_gpu_micro_batch(per_gpu: Optional[int], global_: Optional[int], world_size: int) -> int:
    """verl's deprecated global micro-batch size is divided by the world size; per-GPU wins."""
    if per_gpu is not None:
        return per_gpu
    if global_ is not None:
        return max(1, global_ // max(1, world_size))
    return DEFAULT_MICRO_BATCH


def micro_batching(cfg: RLHFConfig, role: Role, world_size: int = 1) -> MicroBatching:
    """How ``role``'s forwards are cut, with verl's fall-backs:

    actor        actor.use_dynamic_bsz, ppo_max_token_len_per_gpu, ppo_micro_batch_size_per_gpu
    critic       critic.* of the same names; use_dynamic_bsz null = the actor's
    rollout/ref  log_prob_use_dynamic_bsz (null = actor.use_dynamic_bsz),
                 log_prob_max_token_len_per_gpu (null = actor.ppo_max_token_len_per_gpu),
                 log_prob_micro_batch_size_per_gpu
    reward_model micro_batch_size_per_gpu; use_dynamic_bsz null = the critic's;
                 budget = critic.forward_max_token_len_per_gpu (null = critic.ppo_max_token_len_per_gpu)
    """
    return role_batching(cfg.actor_rollout_ref, cfg.critic, role, world_size, cfg.reward_model)


def role_batching(arr: ActorRolloutRefConfig, c: CriticConfig, role: Role, world_size: int = 1,
                  rm: Optional[RewardModelConfig] = None) -> MicroBatching:
    """``micro_batching`` from the sections it reads (the reward model's for its role only)."""
    # each role reads only its own keys and their fall-backs: what a stage reads is what it hashes
    a = arr.actor
    if role in ("actor", "critic"):
        return trained_batching(a, c, role, world_size)
    if role == "reward_model":
        if rm is None:
            raise TypeError("role_batching(..., 'reward_model') needs the reward_model section")
        return reward_model_batching(rm, c.use_dynamic_bsz, a.use_dynamic_bsz, c.forward_max_token_len_per_gpu,
                                     c.ppo_max_token_len_per_gpu, world_size)
    src = arr.rollout if role == "rollout" else arr.ref
    return log_prob_batching(src.log_prob_use_dynamic_bsz, src.log_prob_max_token_len_per_gpu,
                             src.log_prob_micro_batch_size_per_gpu, src.log_prob_micro_batch_size,
                             a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu, world_size)


def trained_batching(a: ActorConfig, c: CriticConfig, role: Literal["actor", "critic"],
                     world_size: int = 1) -> MicroBatching:
    """A trained role's forwards and backwards in the update: its own keys; the critic's null
    use_dynamic_bsz is the actor's."""
    if role == "actor":
        return MicroBatching(a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu,
                             per_gpu_micro_batch(a.ppo_micro_batch_size_per_gpu, a.ppo_micro_batch_size, world_size))
    critic_dynamic = a.use_dynamic_bsz if c.use_dynamic_bsz is None else c.use_dynamic_bsz
    return MicroBatching(critic_dynamic, c.ppo_max_token_len_per_gpu,
                         per_gpu_micro_batch(c.ppo_micro_batch_size_per_gpu, c.ppo_micro_batch_size, world_size))


def reward_model_batching(rm: RewardModelConfig, critic_dynamic: Optional[bool], actor_dynamic: bool,
                          critic_forward_max_token_len: Optional[int], critic_max_token_len: int,
                          world_size: int = 1) -> MicroBatching:
    """The reward model's forwards: its use_dynamic_bsz, null = the critic's (null = the actor's); the
    budget is the critic's forward budget, null = its training budget, as verl's."""
    critic = actor_dynamic if critic_dynamic is None else critic_dynamic
    return MicroBatching(critic if rm.use_dynamic_bsz is None else rm.use_dynamic_bsz,
                         critic_forward_max_token_len or critic_max_token_len,
                         per_gpu_micro_batch(rm.micro_batch_size_per_gpu, rm.micro_batch_size, world_size))


def log_prob_batching(use_dynamic_bsz: Optional[bool], max_token_len: Optional[int], micro_batch_size_per_gpu:
                      Optional[int], micro_batch_size: Optional[int], actor_dynamic: bool, actor_max_token_len: int,
                      world_size: int = 1) -> MicroBatching:
    """A log-prob pass's micro-batches (the rollout's or the reference's log_prob_* keys): a null
    use_dynamic_bsz or budget falls back to the actor's, as verl's."""
    dynamic = actor_dynamic if use_dynamic_bsz is None else use_dynamic_bsz
    return MicroBatching(dynamic, max_token_len or actor_max_token_len,
                         per_gpu_micro_batch(micro_batch_size_per_gpu, micro_batch_size, world_size))


def critic_value_batching(arr: ActorRolloutRefConfig, c: CriticConfig, world_size: int = 1) -> MicroBatching:
    """The critic's forward in scoring (values): forward_* keys, falling back to its ppo_* keys."""
    train = role_batching(arr, c, "critic", world_size)
    per_gpu = c.forward_micro_batch_size_per_gpu or train.micro_batch_size
    return MicroBatching(train.use_dynamic_bsz, c.forward_max_token_len_per_gpu or c.ppo_max_token_len_per_gpu,
                         per_gpu)


def frozen_param_offload(cfg: RLHFConfig, role: Literal["ref", "reward_model"]) -> bool:
    """verl's ``fsdp_config.param_offload`` of a frozen model (``offload_policy`` implies it, as
    for the trained roles): its weights wait in host memory between passes (``scoring.frozen``)."""
    return param_offload(cfg.actor_rollout_ref.ref.fsdp_config if role == "ref" else cfg.reward_model.model.fsdp_config)


def param_offload(fsdp: FSDPConfig) -> bool:
    """A frozen model's ``fsdp_config``: its weights wait in host memory (param_offload or offload_policy)."""
    return bool(fsdp.param_offload or fsdp.offload_policy)


def critic_epochs(a: ActorConfig, c: CriticConfig) -> int:
    return c.ppo_epochs or a.ppo_epochs


def critic_shuffle(a: ActorConfig, c: CriticConfig) -> bool:
    return a.shuffle if c.shuffle is None else c.shuffle


def critic_loss_agg_mode(a: ActorConfig, c: CriticConfig) -> str:
    return c.loss_agg_mode or a.loss_agg_mode


def critic_use_remove_padding(critic: CriticConfig, actor_model: ModelConfig) -> bool:
    """The critic's model.use_remove_padding, null = the actor's."""
    m = critic.model.use_remove_padding
    return actor_model.use_remove_padding if m is None else m


def loss_scale_factor(a: ActorConfig, max_response_length: int) -> float:
    """The constant divisor of seq-mean-token-sum-norm: actor.loss_scale_factor, else the configured
    response length (verl divides by the padded response width, which is data.max_response_length)."""
    return float(a.loss_scale_factor) if a.loss_scale_factor is not None else float(max_response_length)


def scheduler_type(optim: OptimConfig) -> str:
    """verl's warmup_style (older name) wins over lr_scheduler_type when set."""
    return optim.warmup_style or optim.lr_scheduler_type


def warmup_steps(optim: OptimConfig, total_steps: int) -> int:
    """lr_warmup_steps when >= 0, else int(lr_warmup_steps_ratio × total steps), as verl computes it."""
    if optim.lr_warmup_steps >= 0:
        return optim.lr_warmup_steps
    return int(optim.lr_warmup_steps_ratio * total_steps)


def steps_per_epoch(train_batch_size: int, train_prompts: int) -> int:
    """Training steps in one pass over the prompts: verl's dataloader drops the last partial batch.
    A run with fewer prompts than one batch is refused after preprocess, as verl's empty dataloader
    refuses to start (``run.plan.check_prompt_supply``); counted alone, they make one smaller step."""
    if train_prompts <= 0:
        return 0
    return max(1, train_prompts // train_batch_size)


def total_iterations(cfg: RLHFConfig, train_prompts: int) -> int:
    """Training steps of the run (``run_steps`` of the config's trainer.* and data.train_batch_size)."""
    t = cfg.trainer
    return run_steps(t.total_iterations, t.total_training_steps, t.total_epochs, cfg.data.train_batch_size,
                     train_prompts)


def run_steps(total_iterations: Optional[int], total_training_steps: Optional[int], total_epochs: int,
              train_batch_size: int, train_prompts: int) -> int:
    """trainer.total_iterations (ours) when set, else trainer.total_training_steps (verl) when set,
    else total_epochs × steps per epoch (verl)."""
    if total_iterations is not None:
        return total_iterations
    if total_training_steps is not None:
        return total_training_steps
    return total_epochs * steps_per_epoch(train_batch_size, train_prompts)


def update_nodes(trainer: TrainerConfig, cuda_devices: int) -> tuple[int, int]:
    """(nnodes, processes per node) of the update (``processes_per_node`` of the trainer section)."""
    return processes_per_node(trainer.nproc, trainer.nnodes, trainer.n_gpus_per_node, cuda_devices)


def processes_per_node(nproc: Optional[int], nnodes: int, n_gpus_per_node: Optional[int],
                       cuda_devices: int) -> tuple[int, int]:
    """(nnodes, processes per node) of the update: trainer.nproc / nnodes when trainer.nproc is set
    (the schema keeps it a multiple); on GPUs n_gpus_per_node (null = every visible device); on CPU
    one process per node (n_gpus_per_node names GPUs, and there are none). Every node is assumed
    to be like node 0, where ``cuda_devices`` was counted."""
    if nproc is not None:
        return nnodes, nproc // nnodes
    if cuda_devices == 0:
        return nnodes, 1
    return nnodes, n_gpus_per_node if n_gpus_per_node is not None else cuda_devices


def update_world_size(trainer: TrainerConfig, cuda_devices: int) -> int:
    """Processes of the update, all nodes together (verl's world = nnodes × n_gpus_per_node)."""
    nnodes, per_node = update_nodes(trainer, cuda_devices)
    return nnodes * per_node


def ray_address(trainer: TrainerConfig, environ: Mapping[str, str]) -> str:
    """The Ray cluster a multi-node update's ranks go to: trainer.ray_address, else $RAY_ADDRESS, else
    "auto" (the cluster this node belongs to)."""
    return trainer.ray_address or environ.get("RAY_ADDRESS") or "auto"


def critic_loss_scale_factor(a: ActorConfig, c: CriticConfig, max_response_length: int) -> float:
    """The critic's seq-mean-token-sum-norm divisor: critic.loss_scale_factor, else the actor's
    (verl 0.9.1 interpolates it), else the padded response width, data.max_response_length."""
    factor = c.loss_scale_factor
    return float(factor) if factor is not None else loss_scale_factor(a, max_response_length)


def rollout_correction(c: RolloutCorrectionConfig) -> RolloutCorrection:
    """algorithm.rollout_correction as the plain settings the math takes."""
    return RolloutCorrection(rollout_is=c.rollout_is, rollout_is_threshold=c.rollout_is_threshold,
                             rollout_is_batch_normalize=c.rollout_is_batch_normalize, rollout_rs=c.rollout_rs,
                             rollout_rs_threshold=c.rollout_rs_threshold, bypass_mode=c.bypass_mode,
                             loss_type=c.loss_type)


def policy_loss_mode(a: ActorConfig, correction: RolloutCorrectionConfig) -> str:
    """The policy loss the update uses: bypass_mode when algorithm.rollout_correction.bypass_mode is on
    (verl switches to it there), else actor.policy_loss.loss_mode."""
    return "bypass_mode" if correction.bypass_mode else a.policy_loss.loss_mode


@dataclass(frozen=True)
class RoleUpdate:
    """One trained role's update settings, resolved as verl resolves them (the critic's null keys
    take the actor's)."""

    epochs: int
    mini_batch_sequences: int
    """Sequences per optimizer step over all processes (``mini_batch_sequences``)."""
    shuffle: bool
    micro_batching: MicroBatching
    use_remove_padding: bool
    """Packed rows: model.use_remove_padding (the critic's, else the actor's)."""
    loss_agg_mode: str
    loss_scale_factor: float


@dataclass(frozen=True)
class UpdateValues:
    """Every derived value one update reads, resolved in one call (``update_values``): the training
    loop's settings are built from these and the section's plain keys, with no second trip here."""

    actor: RoleUpdate
    critic: Optional[RoleUpdate]
    """None in a run without a critic (``uses_critic``): its keys are then not read."""
    policy_loss_mode: str
    rollout_correction: RolloutCorrection


def update_values(a: ActorConfig, model: ModelConfig, c: CriticConfig, *, n: int, max_response_length: int,
                  critic_on: bool, correction: RolloutCorrectionConfig, world_size: int) -> UpdateValues:
    """The derived values of an update on ``world_size`` ranks (the micro-batch size divides by it),
    from the sections it reads: the actor's and the critic's, the actor's model, rollout.n (a
    mini-batch is prompts × n), the response length (the loss's scale), whether a critic trains
    (``has_critic``) and algorithm.rollout_correction."""
    actor = RoleUpdate(a.ppo_epochs, mini_batch_prompts(a, c, "actor") * n, a.shuffle,
                       trained_batching(a, c, "actor", world_size), model.use_remove_padding,
                       a.loss_agg_mode, loss_scale_factor(a, max_response_length))
    critic = None if not critic_on else RoleUpdate(
        critic_epochs(a, c), mini_batch_prompts(a, c, "critic") * n, critic_shuffle(a, c),
        trained_batching(a, c, "critic", world_size), critic_use_remove_padding(c, model),
        critic_loss_agg_mode(a, c), critic_loss_scale_factor(a, c, max_response_length))
    return UpdateValues(actor, critic, policy_loss_mode(a, correction), rollout_correction(correction))


def role_model_key(cfg: RLHFConfig, role: str = "actor") -> str:
    """The model key (a directory, a hub id, ``tiny``) ``role``'s weights start from (``trained_model_key``)."""
    return trained_model_key(cfg.actor_rollout_ref.model, cfg.critic, role)


def trained_model_key(actor_model: ModelConfig, critic: CriticConfig, role: str = "actor") -> str:
    """The actor's actor_rollout_ref.model.path; the critic's critic.model.path, else the actor's."""
    if role == "critic" and critic.model.path:
        return critic.model.path
    return actor_model.path
