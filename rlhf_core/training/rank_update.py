"""One iteration's PPO update on one rank: the engines, the training loop, what rank 0 records.

``iteration_plan`` sets up the one training loop (``ppo.run_ppo``); ``training.resident`` runs it in
the trainer that holds the engines (kept for a flow run, or made for one update). An update starts from the
last-good iteration — its actor, critic and optimizer state, so iteration k+1 continues the AdamW
moments and the lr schedule of iteration k — or from the initial models before any commit. Rank 0
writes ``iter_K/metrics.json`` and ``iter_K/state.json`` (``finish_update``).

As verl's trainer: the critic trains first, then the actor unless the step is a critic warm-up step
(``UpdateSettings.actor_updates``; the actor's weights, optimizer state and lr position are then
saved unchanged); each role has its own mini-batch, micro-batch, epoch and shuffle settings; and
each role's lr schedule moves one step per iteration it trained in.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import resource
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch

from rlhf_core.config import RLHFConfig, resolve
from rlhf_core.config.reads import build
from rlhf_core.config.schema import OptimConfig
from rlhf_core.errors import CheckpointError
from rlhf_core.io.atomic import atomic_write_json
from rlhf_core.paths import resolve_model_path
from rlhf_core.run.integrity import not_its_own
from rlhf_core.run.layout import RunDir
from rlhf_core.run.lifecycle import checkpoint_before, committed_iterations
from rlhf_core.io.checksums import verify_checkpoint
from rlhf_core.models.threads import module_largest_matrix, small_matmuls
from rlhf_core.run.models import (
    actor_path, critic_backbone, critic_path, initial_actor_path, reference_path, reward_model_path,
)
from rlhf_core.training.batch import MicroBatchPlan, PPOData, check_budget, read_advantages
from rlhf_core.training.checkpoint import seed_rng
from rlhf_core.training.checkpoint_load import load_optimizer_state, load_rng
from rlhf_core.training.distributed import DistInfo, all_reduce
from rlhf_core.training.ds_config import torch_dtype
from rlhf_core.training.fingerprint import weights_sample
from rlhf_core.training.lineage import write_state_record
from rlhf_core.training.flops import floor_metrics, training_flops, verl_promised_flops, verl_update_flops
from rlhf_core.training.memory import ModelShape, Shapes, check_update_memory, memory_settings
from rlhf_core.training.engines import (LoraSettings, TrainEngine, build_train_engine, present, load_actor_model, load_critic_model,
                                        lr_schedule)
from rlhf_core.training.ppo import ActorLoss, CriticLoss, PPOOutcome, RoleSchedule, aggregate
from rlhf_core.training.settings import EngineSettings, UpdateSettings, run_length, update_settings


@dataclass(frozen=True)
class UpdateSources:
    """Where this iteration's weights and optimizer state come from."""

    actor: Path
    """The actor model (with LoRA: the frozen base)."""
    adapter: Optional[Path]
    """LoRA adapters to continue (None: fresh adapters)."""
    critic: Optional[Path]
    """None in a run without a critic (``config.resolve.uses_critic``)."""
    tokenizer: Path
    resume: Optional[Path]
    """Last-good checkpoint whose optimizer state continues here (None before the first commit)."""


def resolve_sources(cfg: RLHFConfig, run: RunDir, iteration: int) -> UpdateSources:
    """The weights iteration ``iteration`` starts from — the checkpoint of the latest earlier
    committed iteration (``checkpoint_before``), else the initial models — the same ones its rollout
    and score used, also when an old iteration is rerun after later ones committed."""
    ckpt = checkpoint_before(run, iteration)
    foreign = not_its_own(run, max(j for j in committed_iterations(run) if j < iteration)) if ckpt is not None else None
    if foreign:  # never trained on, whatever loads it
        raise CheckpointError(f"{ckpt} {foreign}; `rlhf run --resume {run.root}` removes it and rebuilds the "
                              "state from its record")
    lora = LoraSettings.from_config(cfg.actor_rollout_ref.model)
    adapter = None
    if lora is not None:
        actor = initial_actor_path(cfg)
        if ckpt is not None:
            adapter = ckpt / "actor_adapter"
            if not adapter.is_dir():
                raise CheckpointError(
                    f"checkpoint {ckpt} has no actor_adapter/ (it was trained without LoRA) but "
                    "actor_rollout_ref.model.lora_rank > 0; keep lora_rank=0 for this run, or start a new run")
    else:
        actor = actor_path(cfg, run, iteration)
    tok = cfg.actor_rollout_ref.model.tokenizer_path
    return UpdateSources(actor=actor, adapter=adapter, critic=critic_path(cfg, run, iteration),
                         tokenizer=resolve_model_path(tok) if tok else actor, resume=ckpt)


def micro_batch_plan(cfg: RLHFConfig, role: str = "actor", world_size: int = 1) -> MicroBatchPlan:
    """``role``'s micro-batching in the update: verl's use_dynamic_bsz, token budget and per-GPU
    size for the actor or the critic; packed rows follow use_remove_padding."""
    return getattr(build(update_settings, cfg, world_size=world_size), role).plan


def actor_loss_from_config(cfg: RLHFConfig) -> ActorLoss:
    """The actor's loss as the update builds it (``update_settings``)."""
    return build(update_settings, cfg, world_size=1).actor.loss_fn


def critic_loss_from_config(cfg: RLHFConfig) -> CriticLoss:
    """The critic's loss as the update builds it (``update_settings``; a run without a critic has none)."""
    return build(update_settings, cfg, world_size=1).critic.loss_fn


def training_steps(cfg: RLHFConfig, run: Optional[RunDir]) -> int:
    """The run's training steps, for the lr schedules (``settings.RunLength.steps``): 0 when no
    schedule needs them; counted from the run's prompts/train.parquet, as verl derives them, when
    neither trainer.total_iterations (the flow fills it in) nor trainer.total_training_steps is set."""
    return build(run_length, cfg).steps(
        lambda: run.train_prompt_count() if run is not None and run.train_prompts.is_file() else None)


def lr_schedule_for(optim: OptimConfig, total_steps: int):
    """verl's schedule of one optimizer config (``engines.lr_schedule``)."""
    return lr_schedule(resolve.scheduler_type(optim), resolve.warmup_steps(optim, total_steps), total_steps,
                       optim.min_lr_ratio, optim.num_cycles)


def engine_key(settings: EngineSettings) -> str:
    """A digest of what the engines are built from, except what each update sets afresh (the base
    learning rates: a retry halves the actor's). A change — a resume with another ZeRO stage, say —
    rebuilds them."""
    facts = asdict(settings)
    for role in ("actor", "critic"):
        if facts[role] is not None:
            facts[role]["optim"].pop("lr")
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()


def build_engines(settings: EngineSettings, sources: UpdateSources) -> tuple[TrainEngine, Optional[TrainEngine]]:
    """The actor and critic engines (critic None in a run without one)."""
    a, device = settings.actor, settings.device
    actor_model = load_actor_model(sources.actor, torch_dtype(a.dtype), lora=settings.lora,
                                   adapter_path=sources.adapter, gradient_checkpointing=a.gradient_checkpointing,
                                   seed=settings.seed, attention=a.attention, ds_config=a.ds_config)
    actor = build_train_engine("actor", actor_model, a.optim, a.ds_config, a.dtype,
                               lr_schedule_for(a.optim, settings.total_steps), device=device)
    actor.lora = settings.lora
    c = settings.critic
    if c is None or sources.critic is None:
        return actor, None
    critic_model = load_critic_model(sources.critic, torch_dtype(c.dtype),
                                     gradient_checkpointing=c.gradient_checkpointing, attention=c.attention,
                                     ds_config=c.ds_config)
    critic = build_train_engine("critic", critic_model, c.optim, c.ds_config, c.dtype,
                                lr_schedule_for(c.optim, settings.total_steps), device=device)
    return actor, critic


def _zero_loss(te: TrainEngine, pad_id: int):
    def loss() -> torch.Tensor:
        device = next(te.module.parameters()).device
        return te.engine(input_ids=torch.tensor([[pad_id, pad_id]], device=device)).logits.sum() * 0.0

    return loss


def resume_optimizers(directory: Path, engines: list[TrainEngine], pad_id: int) -> None:
    """Continue the optimizer state saved in checkpoint ``directory`` (verified first): each rank
    reads only its own shard when the world and ZeRO stage are the same as when it was written."""
    verify_checkpoint(directory)
    for te in engines:
        load_optimizer_state(directory, te, _zero_loss(te, pad_id))


def start_rng(seed: int, sources: UpdateSources) -> None:
    """Set the RNG this update trains with: the state saved in the checkpoint it starts from, else
    ``trainer.seed``. Called on every path (fresh, resumed, retried, after a rollout and score that were
    skipped or ran in this process), last before training, so what the process did before never reaches
    this iteration's checkpoint or any later one."""
    if sources.resume is not None:
        load_rng(sources.resume)  # verified by resume_optimizers
    else:
        seed_rng(seed)


@contextlib.contextmanager
def cpu_threads(device: str, largest: int, world_size: int) -> Iterator[int]:
    """Set torch's (process-wide) thread count for the update, restoring it afterwards: one thread per
    rank for a model of small matmuls (``models.threads``: its largest weight matrix), else the rank's
    share of the cores."""
    before = torch.get_num_threads()
    if device != "cpu":
        yield before
        return
    cores = max(1, (os.cpu_count() or 1) // world_size)
    threads = 1 if small_matmuls(largest) else min(before, cores)
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(before)


def concurrent_roles(setting: str, device: str, threads: int, world_size: int) -> bool:
    """Whether the critic and the actor train at the same time (``trainer.concurrent_critic_actor``):
    never with several ranks; 'auto' = on CPU when each role gets one intra-op thread and a second
    core is there to run the other (the small-model case of ``cpu_threads``)."""
    if setting == "never" or world_size > 1:
        return False
    if setting == "always":
        return True
    return device == "cpu" and threads == 1 and (os.cpu_count() or 1) >= 2


def reset_peak_rss() -> None:
    """Start a fresh peak-memory window (Linux: writing 5 to /proc/self/clear_refs resets VmHWM), so
    perf/peak_rss_gb is the update's own peak even in a process that ran other stages before."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_rss_gb() -> float:
    """Peak resident memory (GiB) since ``reset_peak_rss``: VmHWM, else the process's ru_maxrss."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024 ** 2  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2  # KiB on Linux


def _pad_id(path: Path) -> int:
    from transformers import AutoConfig

    pad = getattr(AutoConfig.from_pretrained(path), "pad_token_id", None)
    return int(pad) if pad is not None else 0


def trainer_state(settings: UpdateSettings, iteration: int, sources: UpdateSources, steps: int, state_id: str) -> dict:
    """What a checkpoint saves as trainer_state.json. ``state_id``: the lineage id of the state
    (``iter_k/state.json``'s "id"), which binds the checkpoint to its run's record: a checkpoint
    swapped in from another run, or from another iteration, names another id (``run.integrity``)."""
    lora = settings.lora
    return {
        "iteration": iteration,
        "state_id": state_id,
        "data_position": {"iteration": iteration, "epochs": settings.actor.epochs,
                          "optimizer_steps_this_iteration": steps, "next_iteration": iteration + 1},
        "sources": {"actor": str(sources.actor), "adapter": str(sources.adapter) if sources.adapter else None,
                    "critic": str(sources.critic) if sources.critic else None, "resumed_from": str(sources.resume) if sources.resume else None},
        "lora": None if lora is None else {"base": str(sources.actor), "rank": lora.rank, "alpha": lora.alpha,
                                           "target_modules": lora.target_modules},
    }


def role_schedules(settings: UpdateSettings, actor: TrainEngine, critic: Optional[TrainEngine],
                   iteration: int) -> list[RoleSchedule]:
    """What trains this iteration, critic first (verl's order): each role with its own budgets,
    mini-batch (prompts × rollout.n sequences), epochs and shuffle; the actor only when
    ``actor_updates`` (verl's critic_warmup); no critic in a run without one."""
    roles = [] if critic is None or settings.critic is None else [RoleSchedule(critic, settings.critic)]
    if settings.actor_updates(iteration):
        roles.append(RoleSchedule(actor, settings.actor))
    return roles


def check_update_data(settings: UpdateSettings, run: RunDir, iteration: int) -> PPOData:
    """Iteration ``iteration``'s advantages table, checked against both roles' token budgets."""
    data = read_advantages(run.advantages(iteration))
    for role in [r for r in (settings.critic, settings.actor) if r is not None]:
        check_budget(data, role.plan, run.advantages(iteration))
    return data


def refuse_what_cannot_fit(cfg: RLHFConfig, device: str, world_size: int, resident: bool) -> None:
    """A config whose memory estimate does not fit the device is refused before any engine is built
    (``memory.check_update_memory``); it reads every model's shape, and changes no output."""
    # the initial models' shapes: a later checkpoint has the same ones, and one held only in memory has no file
    shapes = Shapes.read(initial_actor_path(cfg), critic_backbone(cfg) if resolve.uses_critic(cfg) else None,
                         reference_path(cfg), reward_model_path(cfg))
    check_update_memory(memory_settings(cfg, world_size), shapes, device, resident=resident,
                        announce=int(os.environ.get("RANK", "0")) == 0)


def open_engines(cfg: RLHFConfig, settings: EngineSettings, sources: UpdateSources, *,
                 resident: bool = False) -> tuple[TrainEngine, Optional[TrainEngine], int]:
    """(actor, critic, pad id): engines built from ``settings`` on ``sources``' weights, with the
    optimizer state and the RNG of the checkpoint they start from (``sources.resume``), else fresh
    and seeded. A config whose memory estimate does not fit the device is refused first
    (``memory.check_update_memory``)."""
    pad_id = _pad_id(sources.actor)
    refuse_what_cannot_fit(cfg, settings.device, settings.world_size, resident)
    actor, critic = build_engines(settings, sources)
    with cpu_threads(settings.device, module_largest_matrix(actor.module), settings.world_size):
        if sources.resume is not None:
            resume_optimizers(sources.resume, present(actor, critic), pad_id)
        start_rng(settings.seed, sources)
    return actor, critic, pad_id


@dataclass(frozen=True)
class IterationPlan:
    """How one iteration's PPO runs on this rank: the roles in training order, whether they train at
    the same time, the seed of the mini-batch order, the intra-op threads."""

    roles: list[RoleSchedule]
    concurrent: bool
    seed: str
    threads: int


@contextlib.contextmanager
def iteration_plan(settings: UpdateSettings, iteration: int, actor: TrainEngine, critic: Optional[TrainEngine],
                   dist: DistInfo, device: str) -> Iterator[IterationPlan]:
    """The plan of iteration ``iteration``'s PPO with engines that already hold the state it starts from
    (weights, optimizer, lr position) and the RNG set to that state's, and this rank's intra-op threads
    set for the block. The block runs ``run_ppo(plan.roles, ...)``, the one training loop of both the
    update and the replay that rebuilds a state (``training.resident``); ``iteration_metrics`` reads
    its outcome."""
    with cpu_threads(device, module_largest_matrix(actor.module), dist.world_size) as threads:
        yield IterationPlan(roles=role_schedules(settings, actor, critic, iteration),
                            concurrent=concurrent_roles(settings.concurrent_critic_actor, device, threads,
                                                        dist.world_size),
                            seed=f"{settings.seed}:{iteration}", threads=threads)


def iteration_metrics(settings: UpdateSettings, iteration: int, plan: IterationPlan, data: PPOData, outcome: PPOOutcome,
                      device: str, dist: DistInfo) -> dict[str, float]:
    """The iteration's metrics from ``run_ppo``'s outcome (verl's reductions: ``ppo.aggregate``), its
    throughput and floors, and how it ran."""
    metrics = aggregate(outcome)
    metrics.update(update_perf(plan.roles, data, outcome, device, dist.world_size))
    metrics["actor/updated"] = float(settings.actor_updates(iteration))  # 0: a critic warm-up step
    metrics["perf/peak_rss_gb"] = float(all_reduce(torch.tensor(peak_rss_gb()), op="max"))
    metrics["perf/world_size"] = float(dist.world_size)
    metrics["perf/threads_per_rank"] = float(plan.threads)
    metrics["perf/concurrent_critic_actor"] = float(plan.concurrent)
    return metrics


def update_perf(roles: list[RoleSchedule], data: PPOData, outcome: PPOOutcome, device: str,
                world_size: int) -> dict[str, float]:
    """verl's ``perf/mfu/<role>`` (its FLOP estimate of one epoch over the role's training seconds, times
    its epochs, over its promised device FLOP/s and the world size: ``training.flops``), each role's
    training-loop seconds, and the stage's model FLOPs and floor (every role's forward + backward, the
    actor's LM head on response positions); {} when a model's shape cannot be read."""
    out: dict[str, float] = {}
    total = 0.0
    lengths, responses = data.lengths, sum(data.response_lengths)
    for role in roles:
        te, seconds = role.te, outcome.seconds.get(role.te.role, 0.0)
        config = getattr(te.module, "config", None)
        if config is None or not hasattr(config, "to_dict"):
            return {}
        shape = ModelShape.from_dict(config.to_dict())
        total += training_flops(shape, lengths, responses if te.role == "actor" else 0, role.how.epochs)
        out[f"perf/{te.role}_update_seconds"] = seconds  # verl's timing_s/update_<role> (run.report.TIMING)
        if seconds > 0:
            out[f"perf/mfu/{te.role}"] = (verl_update_flops(shape, lengths) / seconds * role.how.epochs
                                          / verl_promised_flops(device) / world_size)
    if roles:
        out.update(floor_metrics("update", total, device, roles[-1].te.dtype, devices=world_size))
    return out


def finish_update(cfg: RLHFConfig, run: RunDir, iteration: int, metrics: dict[str, float], outcome: PPOOutcome,
                  actor: TrainEngine, critic: Optional[TrainEngine], dist: DistInfo,
                  identity: tuple[str, dict[str, str]]) -> None:
    """Rank 0 records what the update produced: iter_K/metrics.json and iter_K/state.json.
    ``identity``: ``lineage.state_id`` of the update, computed once by the caller."""
    if not dist.is_main:
        return
    atomic_write_json(run.metrics(iteration), {"iteration": iteration, "stage": "update", "metrics": metrics,
                                               "steps": outcome.steps})
    write_state_record(run, iteration, identity,
                       sample=weights_sample([te.module for te in present(actor, critic)]), cfg=cfg)
