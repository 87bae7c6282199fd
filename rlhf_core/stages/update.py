"""Stage `update`: iter_K/advantages.parquet → iter_K/checkpoint/ + iter_K/metrics.json.

    rlhf stage update --run-dir RUN --iteration K [--nproc N] [-c PRESET] [key=value ...]

PPO trains the actor and the critic with DeepSpeed (ZeRO stage, offload and dtype from
``actor_rollout_ref.actor.deepspeed_config`` / ``critic.deepspeed_config``), starting from the
last-good checkpoint (weights and optimizer state) or the initial models. It writes a checkpoint but
does not move ``last_good.json``: the KL guard decides whether this iteration is kept.

The update runs in the trainer a flow run keeps (``training.resident``); outside a flow (or where a
run cannot keep its models) the same trainer is made for this one update and closed after it
(``run_trainer.one_update_trainer``), writing the checkpoint at once. The processes are
``config.resolve.update_nodes``: trainer.nnodes machines × (trainer.nproc / nnodes, else
trainer.n_gpus_per_node on GPUs, else 1). With N > 1 in all the trainer is a worker group of N
data-parallel ranks under torchrun (gloo on CPU, nccl on CUDA; OMP_NUM_THREADS = cores // processes
per node); the result matches one process on the same batch up to floating-point summation order.
With nnodes > 1 a Ray cluster places the ranks on its nodes (``training.ray_ranks``); the run
directory must be on storage every node sees.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import pyarrow.parquet as pq

from rlhf_core.config import RLHFConfig
from rlhf_core.config.reads import build
from rlhf_core.errors import DataError, RLHFError
from rlhf_core.run.layout import RunDir
from rlhf_core.run.session import RunSession
from rlhf_core.stages.base import StageResult, stage_record
from rlhf_core.training import lineage
from rlhf_core.training.run_trainer import ensure_state, one_update_trainer
from rlhf_core.training.settings import update_keys, update_world


def config_sections(cfg: RLHFConfig) -> tuple[str, ...]:
    """The keys the update's builders read (``training.settings``): also every state id's."""
    return update_keys(cfg)


STAGE_METRICS = ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/kl_loss", "actor/entropy",
                 "actor/grad_norm", "critic/vf_loss", "critic/grad_norm", "perf/tokens_per_s", "perf/peak_rss_gb")


def run_update(cfg: RLHFConfig, run: RunDir, iteration: Optional[int] = None, force: bool = False,
               session: Optional[RunSession] = None) -> StageResult:
    """Train iteration ``iteration``'s actor and critic; skipped when inputs and config are unchanged.
    ``session``: the flow run's, whose trainer keeps the models (None: a trainer for this update)."""
    session = session or RunSession()
    if iteration is None or iteration < 1:
        raise RLHFError("update is a per-iteration stage: give --iteration K (K >= 1)")
    if not run.advantages(iteration).is_file():
        raise DataError(f"{run.advantages(iteration)} not found: run `rlhf stage gae --run-dir {run.root} "
                        f"--iteration {iteration}` first")

    with stage_record(stage="update", cfg=cfg, run=run, iteration=iteration,
                      inputs=lineage.update_inputs(cfg, run, iteration), config_sections=config_sections(cfg),
                      force=force) as record:
        if record.skipped:
            return record.skipped
        nproc = build(update_world, cfg)
        kept = session.trainer is not None  # the flow keeps the engines: they hold the state this iteration starts from
        if not kept:
            ensure_state(session, run, lineage.start_iteration(run, iteration))  # a start only in its record
        # the trainer times its own I/O (process start, setup, snapshot, replay, checkpoint) in io.timing
        with (contextlib.nullcontext(session.trainer) if kept else one_update_trainer(cfg, run, iteration)) as trainer:
            metrics = trainer.update(cfg, iteration)
        rows = pq.ParquetFile(run.advantages(iteration)).metadata.num_rows
        shown = ", ".join(f"{k}={metrics[k]:.4g}" for k in STAGE_METRICS if k in metrics)  # actor/, critic/ kept apart
        return record.done(StageResult(
            stage="update", iteration=iteration,
            outputs={"checkpoint": str(run.checkpoint(iteration)), "state": str(run.state_record(iteration)),
                     "metrics": str(run.metrics(iteration))},
            rows={"sequences": rows}, metrics=metrics,
            summary=[f"{rows} sequences, {int(metrics.get('actor/num_steps', 0))} actor steps on {nproc} "
                     f"process(es): {shown}",
                     f"state held in memory (a checkpoint at save points): {run.checkpoint(iteration)}"
                     if kept else f"checkpoint: {run.checkpoint(iteration)}"]))
