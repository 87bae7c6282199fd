"""Stage `update`: iter_K/advantages.parquet → iter_K/checkpoint/ + iter_K/metrics.json.

    rlhf stage update --run-dir RUN --iteration K [--nproc N] [-c PRESET] [key=value ...]

PPO trains the actor and the critic with DeepSpeed (ZeRO stage, offload and dtype from
``actor_rollout_ref.actor.deepspeed_config`` / ``critic.deepspeed_config``), starting from the
last-good checkpoint (weights and optimizer state) or the initial models. It writes a checkpoint but
does not move ``last_good.json``: the KL guard decides whether this iteration is kept.

The processes are ``config.resolve.update_nodes``: trainer.nnodes machines × (trainer.nproc / nnodes,
else trainer.n_gpus_per_node on GPUs, else 1). With N > 1 in all the stage starts N data-parallel
ranks with torchrun (gloo on CPU, nccl on CUDA; OMP_NUM_THREADS = cores // processes per node),
waits, and reports; the result matches one process on the same batch up to floating-point
summation order. With nnodes > 1 this machine is node 0 and each other node runs `rlhf node join`
(``training.nodes``); the run directory must be on storage every node sees.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Optional

from rlhf_core.config import RLHFConfig, resolve, to_yaml
from rlhf_core.config.machine import cuda_devices
from rlhf_core.errors import DataError, RLHFError
from rlhf_core.io import timing
from rlhf_core.io.atomic import atomic_write_text
from rlhf_core.run.layout import RunDir
from rlhf_core.stages.base import StageResult, execute_stage
from rlhf_core.training import lineage, nodes, resident
from rlhf_core.training.rank_update import read_update_metrics, schedule_needs_total_steps, train_update


def config_sections(cfg: RLHFConfig) -> tuple[str, ...]:
    return lineage.config_sections(cfg, schedule_needs_total_steps(cfg))


STAGE_METRICS = ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/kl_loss", "actor/entropy",
                 "actor/grad_norm", "critic/vf_loss", "critic/grad_norm", "perf/tokens_per_s", "perf/peak_rss_gb")


def _inputs(cfg: RLHFConfig, run: RunDir, iteration: int) -> list[Path]:
    return lineage.update_inputs(cfg, run, iteration)


def launch_ranks(cfg: RLHFConfig, run: RunDir, iteration: int, nnodes: int, nproc_per_node: int) -> None:
    """Run ``train_update`` on ``nnodes`` × ``nproc_per_node`` ranks under torchrun and wait. With
    nnodes > 1 this is node 0 and the other nodes' joiners run the rest (``training.nodes``). The
    ranks' output is passed through to stderr; a rank's user error (``rlhf: error: ...``) becomes
    this stage's error."""
    config_file = run.update_config(iteration)
    if nnodes > 1:  # the ranks see torchrun's MASTER_* (their own world's): they read node 0's address here
        addr, port = nodes.node0_address(cfg)
        cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, master_addr=addr, master_port=port))
    atomic_write_text(config_file, to_yaml(cfg))
    try:
        if nnodes == 1:
            nodes.launch_single_node(run, iteration, config_file, nproc_per_node)
        else:
            nodes.launch_nodes(run, nodes.new_request(run, iteration, config_file, nnodes, nproc_per_node,
                                                      cfg.trainer.master_addr, cfg.trainer.master_port,
                                                      cfg.trainer.node_join_timeout_s))
    finally:
        config_file.unlink(missing_ok=True)


def count_update_io(metrics: dict[str, float], wall: float, separate_processes: bool) -> None:
    """Count the trainer's non-compute seconds into the stage's I/O tally (``io.timing``): its
    setup (process group, data, model loads, DeepSpeed engines, optimizer state:
    perf/setup_seconds) and its checkpoint save (perf/checkpoint_seconds). With torchrun ranks,
    the rest of the launch's wall time outside those and the PPO loop (perf/update_seconds) is
    process start-up (interpreter, imports)."""
    setup = float(metrics.get("perf/setup_seconds", 0.0))
    checkpoint = float(metrics.get("perf/checkpoint_seconds", 0.0))
    timing.add(timing.UPDATE_SETUP, setup)
    timing.add(timing.CHECKPOINT_WRITE, checkpoint)
    if separate_processes:
        timing.add("process_launch", wall - setup - checkpoint - float(metrics.get("perf/update_seconds", 0.0)))


def run_update(cfg: RLHFConfig, run: RunDir, iteration: Optional[int] = None, force: bool = False) -> StageResult:
    """Train iteration ``iteration``'s actor and critic; skipped when inputs and config are unchanged."""
    if iteration is None or iteration < 1:
        raise RLHFError("update is a per-iteration stage: give --iteration K (K >= 1)")
    if not run.advantages(iteration).is_file():
        raise DataError(f"{run.advantages(iteration)} not found: run `rlhf stage gae --run-dir {run.root} "
                        f"--iteration {iteration}` first")

    def body() -> StageResult:
        import pyarrow.parquet as pq

        nnodes, per_node = resolve.update_nodes(cfg, cuda_devices() if cfg.trainer.device != "cpu" else 0)
        nproc = nnodes * per_node
        launched = time.perf_counter()
        trainer = resident.active(run)
        if trainer is not None:  # the flow keeps the engines: they hold the state this iteration starts from
            metrics = trainer.update(cfg, iteration)  # times its own I/O (setup, snapshot, replay) in io.timing
        else:
            resident.ensure_state(cfg, run, lineage.start_iteration(run, iteration))  # a start only in its record
            with timing.opaque():  # the trainer times its own I/O: counted below from its metrics
                if nproc > 1:
                    launch_ranks(cfg, run, iteration, nnodes, per_node)
                    metrics = read_update_metrics(run, iteration)
                else:
                    metrics = train_update(cfg, run, iteration)
            count_update_io(metrics, time.perf_counter() - launched, separate_processes=nproc > 1)
        rows = pq.ParquetFile(run.advantages(iteration)).metadata.num_rows
        shown = ", ".join(f"{k}={metrics[k]:.4g}" for k in STAGE_METRICS if k in metrics)  # actor/, critic/ kept apart
        return StageResult(
            stage="update", iteration=iteration,
            outputs={"checkpoint": str(run.checkpoint(iteration)), "state": str(run.state_record(iteration)),
                     "metrics": str(run.metrics(iteration))},
            rows={"sequences": rows}, metrics=metrics,
            summary=[f"{rows} sequences, {int(metrics.get('actor/num_steps', 0))} actor steps on {nproc} "
                     f"process(es): {shown}",
                     f"state held in memory (a checkpoint at save points): {run.checkpoint(iteration)}"
                     if trainer is not None else f"checkpoint: {run.checkpoint(iteration)}"])

    return execute_stage(stage="update", cfg=cfg, run=run, iteration=iteration, inputs=_inputs(cfg, run, iteration),
                         config_sections=config_sections(cfg), body=body, force=force)
