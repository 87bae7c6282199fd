"""One iteration's PPO update on one rank: advantages table in, checkpoint and metrics out.

``train_update`` is what every rank runs (in the stage's own process for one rank, under torchrun
for several). It starts from the last-good iteration — its actor, critic and optimizer state, so
iteration k+1 continues the AdamW moments and the warm-up of iteration k — or from the initial
models before any commit. Rank 0 writes ``iter_K/checkpoint/`` and ``iter_K/metrics.json``.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from rlhf_core.config import RLHFConfig
from rlhf_core.errors import CheckpointError
from rlhf_core.io.rundir import RunDir
from rlhf_core.training.batch import MicroBatchPlan
from rlhf_core.training.engines import LoraSettings, TrainEngine


@dataclass(frozen=True)
class UpdateSources:
    """Where this iteration's weights and optimizer state come from."""

    actor: Path
    """The actor model (with LoRA: the frozen base)."""
    adapter: Optional[Path]
    """LoRA adapters to continue (None: fresh adapters)."""
    critic: Path
    tokenizer: Path
    resume: Optional[Path]
    """Last-good checkpoint whose optimizer state continues here (None before the first commit)."""


def resolve_sources(cfg: RLHFConfig, run: RunDir, iteration: int) -> UpdateSources:
    """The weights iteration ``iteration`` starts from — the checkpoint of the latest earlier
    committed iteration (``checkpoint_before``), else the initial models — the same ones its rollout
    and score used, also when an old iteration is rerun after later ones committed."""
    from rlhf_core.io.pointers import actor_path, checkpoint_before, critic_path, initial_actor_path
    from rlhf_core.paths import resolve_model_path

    ckpt = checkpoint_before(run, iteration)
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


def micro_batch_plan(cfg: RLHFConfig) -> MicroBatchPlan:
    a = cfg.actor_rollout_ref.actor
    return MicroBatchPlan(use_dynamic_bsz=a.use_dynamic_bsz, token_budget=a.ppo_max_token_len_per_gpu,
                          micro_batch_size=a.ppo_micro_batch_size_per_gpu, pack_rows=cfg.data.use_sequence_packing)


def actor_loss_from_config(cfg: RLHFConfig):
    from rlhf_core.training.ppo import ActorLoss

    a = cfg.actor_rollout_ref.actor
    return ActorLoss(
        clip_ratio_low=a.clip_ratio if a.clip_ratio_low is None else a.clip_ratio_low,
        clip_ratio_high=a.clip_ratio if a.clip_ratio_high is None else a.clip_ratio_high,
        clip_ratio_c=a.clip_ratio_c, loss_agg_mode=a.loss_agg_mode, policy_loss=a.policy_loss,
        entropy_coeff=a.entropy_coeff, use_kl_loss=a.use_kl_loss, kl_loss_coef=a.kl_loss_coef,
        kl_loss_type=a.kl_loss_type, temperature=cfg.actor_rollout_ref.rollout.temperature)


def build_engines(cfg: RLHFConfig, sources: UpdateSources, device: str, world_size: int
                  ) -> tuple[TrainEngine, TrainEngine]:
    from rlhf_core.config import effective_deepspeed
    from rlhf_core.training.ds_config import actor_ds_config, critic_ds_config, resolve_dtype, torch_dtype
    from rlhf_core.training.engines import build_engine, load_actor_model, load_critic_model

    m = cfg.actor_rollout_ref.model
    lora = LoraSettings.from_config(m)
    actor_dtype = resolve_dtype(effective_deepspeed(cfg).dtype, device)
    critic_dtype = resolve_dtype(cfg.critic.deepspeed_config.dtype, device)
    actor_model = load_actor_model(sources.actor, torch_dtype(actor_dtype), lora=lora, adapter_path=sources.adapter,
                                   gradient_checkpointing=m.enable_gradient_checkpointing, seed=cfg.trainer.seed)
    actor = build_engine("actor", actor_model, cfg.actor_rollout_ref.actor.optim,
                         actor_ds_config(cfg, device, world_size), actor_dtype)
    actor.lora = lora
    critic_model = load_critic_model(sources.critic, torch_dtype(critic_dtype),
                                     gradient_checkpointing=m.enable_gradient_checkpointing)
    critic = build_engine("critic", critic_model, cfg.critic.optim, critic_ds_config(cfg, device, world_size),
                          critic_dtype)
    return actor, critic


def _zero_loss(te: TrainEngine, pad_id: int):
    def loss() -> torch.Tensor:
        device = next(te.module.parameters()).device
        return te.engine(input_ids=torch.tensor([[pad_id, pad_id]], device=device)).logits.sum() * 0.0

    return loss


def resume_optimizers(directory: Path, engines: list[TrainEngine], pad_id: int) -> None:
    """Continue the optimizer state saved in checkpoint ``directory`` (verified first)."""
    from rlhf_core.training.checkpoint import load_optimizer_files, load_rng, verify_checkpoint
    from rlhf_core.training.optim_state import restore_optimizer_state

    verify_checkpoint(directory)
    for te in engines:
        tensors, meta = load_optimizer_files(directory, te.role)
        try:
            restore_optimizer_state(te, tensors, meta, _zero_loss(te, pad_id))
        except (KeyError, RuntimeError, AssertionError) as exc:
            raise CheckpointError(f"{directory}/deepspeed/{te.role}_optim.safetensors does not fit the {te.role} "
                                  f"being trained ({exc}); was the model or LoRA setting changed mid-run?") from None
    load_rng(directory)


SMALL_MODEL_PARAMS = 100_000_000
"""Below this many actor parameters a CPU update runs on one thread per rank: the tiny model's matmuls
are too small to split, and on a shared machine extra OpenMP threads spin-wait (measured on the tiny
model with 2 busy cores: 4 steps took 0.18 s on 1 thread, 13 s on 2). Same rule as the hf rollout."""


@contextlib.contextmanager
def cpu_threads(device: str, num_params: int, world_size: int) -> Iterator[int]:
    """Set torch's (process-wide) thread count for the update, restoring it afterwards."""
    before = torch.get_num_threads()
    if device != "cpu":
        yield before
        return
    cores = max(1, (os.cpu_count() or 1) // world_size)
    threads = 1 if num_params < SMALL_MODEL_PARAMS else min(before, cores)
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


def _trainer_state(cfg: RLHFConfig, run: RunDir, iteration: int, sources: UpdateSources, steps: int) -> dict:
    return {
        "iteration": iteration,
        "data_position": {"iteration": iteration, "epochs": cfg.actor_rollout_ref.actor.ppo_epochs,
                          "optimizer_steps_this_iteration": steps, "next_iteration": iteration + 1},
        "kl_ctrl": run.read_json(run.kl_ctrl_path),
        "sources": {"actor": str(sources.actor), "adapter": str(sources.adapter) if sources.adapter else None,
                    "critic": str(sources.critic), "resumed_from": str(sources.resume) if sources.resume else None},
        "lora": None if sources.adapter is None and cfg.actor_rollout_ref.model.lora_rank <= 0 else {
            "base": str(sources.actor), "rank": cfg.actor_rollout_ref.model.lora_rank,
            "alpha": cfg.actor_rollout_ref.model.lora_alpha,
            "target_modules": cfg.actor_rollout_ref.model.target_modules},
    }


def train_update(cfg: RLHFConfig, run: RunDir, iteration: int, *, progress: Optional[bool] = None) -> dict[str, Any]:
    """Run the PPO update of ``iteration`` on this rank; returns the per-iteration metrics (the same
    on every rank). Writes ``run.checkpoint(iteration)`` and ``run.metrics(iteration)`` (rank 0)."""
    from rlhf_core.io.atomic import atomic_write_json
    from rlhf_core.training.batch import check_budget, read_advantages
    from rlhf_core.training.checkpoint import save_checkpoint
    from rlhf_core.training.distributed import all_reduce, init_distributed
    from rlhf_core.training.ds_config import resolve_device
    from rlhf_core.training.ppo import CriticLoss, RoleSchedule, aggregate, run_ppo

    reset_peak_rss()
    started = time.perf_counter()
    device = resolve_device(cfg.trainer.device)
    dist = init_distributed(device)
    data = read_advantages(run.advantages(iteration))
    plan = micro_batch_plan(cfg)
    check_budget(data, plan, run.advantages(iteration))
    sources = resolve_sources(cfg, run, iteration)
    pad_id = _pad_id(sources.actor)
    actor, critic = build_engines(cfg, sources, device, dist.world_size)
    a = cfg.actor_rollout_ref.actor
    roles = [RoleSchedule(critic, CriticLoss(cfg.critic.cliprange_value, cfg.critic.loss_agg_mode),
                          cfg.critic.ppo_epochs or a.ppo_epochs),
             RoleSchedule(actor, actor_loss_from_config(cfg), a.ppo_epochs)]
    num_params = sum(getattr(p, "ds_numel", p.numel()) for p in actor.module.parameters())  # ZeRO-3: full size
    with cpu_threads(device, num_params, dist.world_size) as threads:
        if sources.resume is not None:
            resume_optimizers(sources.resume, [actor, critic], pad_id)
        setup_seconds = time.perf_counter() - started
        concurrent = concurrent_roles(cfg.trainer.concurrent_critic_actor, device, threads, dist.world_size)
        outcome = run_ppo(roles, data, plan=plan, mini_batch_size=a.ppo_mini_batch_size,
                          shuffle=a.shuffle, seed=f"{cfg.trainer.seed}:{iteration}", dist=dist, pad_id=pad_id,
                          progress=progress, concurrent=concurrent)
        metrics = aggregate(outcome)
        metrics["perf/peak_rss_gb"] = float(all_reduce(torch.tensor(peak_rss_gb()), op="max"))
        metrics["perf/world_size"] = float(dist.world_size)
        metrics["perf/threads_per_rank"] = float(threads)
        metrics["perf/concurrent_critic_actor"] = float(concurrent)
        state = _trainer_state(cfg, run, iteration, sources, len(outcome.steps.get("actor", [])))
        saving = time.perf_counter()
        save_checkpoint(run.checkpoint(iteration), actor=actor, critic=critic, tokenizer_path=sources.tokenizer,
                        trainer_state=state, dist=dist, lora_base=sources.actor if actor.lora else None)
    metrics["perf/setup_seconds"] = setup_seconds  # process group, data, models, engines, optimizer state
    metrics["perf/checkpoint_seconds"] = time.perf_counter() - saving
    if dist.is_main:
        atomic_write_json(run.metrics(iteration), {"iteration": iteration, "stage": "update", "metrics": metrics,
                                                   "steps": outcome.steps})
    return metrics


def read_update_metrics(run: RunDir, iteration: int) -> dict[str, float]:
    return json.loads(run.metrics(iteration).read_text())["metrics"]
