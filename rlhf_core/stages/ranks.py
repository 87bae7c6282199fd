"""A stage's model passes on several local processes: one per GPU (CPU processes in tests).

    python -m torch.distributed.run --standalone --nproc_per_node D -m rlhf_core.stages.rank_entry \
        score --run-dir RUN --iteration K --config RUN/iter_K/.score_ranks/config.yaml

Each rank reads the stage's input table from the run directory, plans every pass's micro-batches
exactly as one process would, and runs its token-balanced share of them
(``scoring.logprobs.own_micro_batches``: every rank computes the same plan and shares from the same
lengths, so no communication is needed) on its own device (``cuda:LOCAL_RANK``, or the CPU); it
writes ``rank{r}.npz`` into the stage's scratch directory (``RunDir.stage_ranks_dir``). The parent
waits, merges the shares back into table order and removes the scratch. Each micro-batch is laid
out as in one process, so the merged outputs are the one-process stage's bit for bit (tested on CPU
at 2 and 4 processes); sharding the rows instead would change which sequences share a micro-batch,
and with it the last bits of a float32 sum.

The rollout (HF engine) and validation deal whole generation batches instead
(``rollout.generate.own_batches``), each numbered and seeded as in one process. With vLLM each
process is one rank of an engine of rollout.tensor_model_parallel_size ranks (vLLM's external
launcher); the engines deal the prompts of the one-engine call by token load, each prompt seeded by
its place in that call (``rollout.generate.own_prompts``, ``vllm_processes``).

The number of processes is ``stage_processes``: ``trainer.stage_processes`` when set, else every
GPU of the node the update uses (verl's ``trainer.n_gpus_per_node``), else 1 (the CPU). In a flow
run whose update spans several processes, the shares go to the ranks of its worker group instead
(``training.group_trainer.GroupTrainer``, ``share_processes``): no launch, and each rank borrows the
module it trains.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path
import sys
from typing import Sequence

import numpy as np
import torch

from rlhf_core.config import RLHFConfig, to_yaml
from rlhf_core.config.machine import cuda_devices
from rlhf_core.config.resolve import update_world_size
from rlhf_core.config.schema import RolloutConfig, TrainerConfig
from rlhf_core.errors import RLHFError
from rlhf_core.io.atomic import atomic_write_bytes, atomic_write_text
from rlhf_core.rollout.base import GeneratedSample, GenerationStats, SamplingParams
from rlhf_core.rollout.generate import generation_engine, own_batches
from rlhf_core.run.layout import RunDir
from rlhf_core.run.session import RunSession
from rlhf_core.training.ds_config import resolve_device
from rlhf_core.training.launch import stream
from rlhf_core.training.run_trainer import group_of

ENTRY = "rlhf_core.stages.rank_entry"


def stage_processes(trainer: TrainerConfig) -> int:
    """Processes the score stage and the KL guard run their model passes on (see the module doc)."""
    if trainer.stage_processes is not None:
        return trainer.stage_processes
    gpus = cuda_devices() if trainer.device != "cpu" else 0
    if gpus == 0:
        return 1
    return max(1, min(gpus, update_world_size(trainer, gpus) // max(1, trainer.nnodes)))


def share_processes(trainer: TrainerConfig, session: RunSession, items: int) -> int:
    """How many processes a stage deals its ``items`` (sequences, generation batches) to; 0 = none,
    it runs in this process. With the run's worker group (a flow run keeps one): its ranks, always —
    they hold the weights — on GPUs one rank per device; on CPU rank 0 alone, at this process's
    thread count (the ranks share the same cores: splitting would only oversubscribe them). Else
    ``stage_processes`` torchrun processes when that is more than one."""
    group = group_of(session)
    if group is not None:
        return max(1, min(group.world if resolve_device(trainer.device) == "cuda" else 1, items))
    world = min(stage_processes(trainer), items)
    return world if world > 1 else 0


def run_on_ranks(cfg: RLHFConfig, run: RunDir, session: RunSession, iteration: int, stage: str, world: int
                 ) -> list[dict[str, np.ndarray]]:
    """Run ``stage``'s rank entry on ``world`` local processes — the ranks of the session's worker
    group when its flow run keeps one, else a torchrun launch for this stage; returns each rank's
    arrays, rank order."""
    scratch = run.stage_ranks_dir(iteration, stage)
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    group = group_of(session)
    if group is not None:
        try:
            group.run_shares(cfg, iteration, stage, world)
            return [dict(np.load(run.stage_rank_share(iteration, stage, r))) for r in range(world)]
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    config_file = run.stage_ranks_config(iteration, stage)
    atomic_write_text(config_file, to_yaml(cfg))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", f"--nproc_per_node={world}",
           "-m", ENTRY, stage, "--run-dir", str(run.root), "--iteration", str(iteration), "--config", str(config_file)]
    # the parent's intra-op thread count: CPU reductions then split the same way in every process,
    # which keeps the outputs bit-identical to one process (on GPUs it only sizes host-side work)
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()))
    try:
        _launch(cmd, env, f"{stage} on {world} processes", run.launch_log(f"{stage}-iter_{iteration}"))
        return [dict(np.load(run.stage_rank_share(iteration, stage, r))) for r in range(world)]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _launch(cmd: list[str], env: dict, what: str, log: Path) -> None:
    """Run ``cmd``, its output into ``log`` and through to stderr (``nodes.stream``, which stops the
    ranks on Ctrl-C; a quiet console gets the ranks' `rlhf:` lines only); a rank's user error becomes
    ours, any other failure one line with its root cause and the log's name."""
    result = stream(cmd, env, log=log)
    if result.returncode != 0:
        if result.user_errors:  # its message already names the file/key and the fix
            raise RLHFError(result.user_errors[0])
        raise RLHFError(result.failure(what))


def merge_samples(shares: list[dict[str, np.ndarray]], plan: list[list[int]], prompt_rows: Sequence[dict],
                  sampling: SamplingParams) -> list[GeneratedSample]:
    """The ranks' samples (each rank's ``samples``: its batches of ``plan`` in batch order, as JSON)
    back in one-process order: batch by batch, each batch from the rank that owns it (``own_batches``)."""
    world = len(shares)
    by_rank = [iter(json.loads(str(s["samples"]))) for s in shares]
    owner = {b: r for r in range(world) for b in own_batches(plan, prompt_rows, sampling, r, world)}
    return [GeneratedSample(**next(by_rank[owner[b]])) for b, batch in enumerate(plan)
            for _ in range(len(batch) * sampling.n)]


def generation_processes(trainer: TrainerConfig, rollout: RolloutConfig, session: RunSession, batches: int) -> int:
    """Processes a generation (rollout, validation) is dealt to; 0 = this process. The hf engine's
    generation batches go to ``share_processes``; vLLM's prompts to every rank of the run's worker
    group, whose ranks keep the engines for the whole flow run, else to one engine kept in this
    process (the session's ``models.live``), else to ``vllm_processes``."""
    name = generation_engine(rollout)
    group = group_of(session)
    if name == "vllm" and group is not None:  # each rank holds a rank of the run's engines: all take part
        return group.world
    if name == "vllm":
        return 0 if session.live.keeping_engines() else vllm_processes(trainer, rollout)
    return share_processes(trainer, session, batches) if name == "hf" else 0


def vllm_processes(trainer: TrainerConfig, rollout: RolloutConfig) -> int:
    """Processes a vLLM generation runs on when no engine is kept for the run: engines of
    rollout.tensor_model_parallel_size ranks, ``stage_processes`` // TP of them (at least one);
    0 = one engine in this process."""
    tp = rollout.tensor_model_parallel_size
    world = tp * max(1, stage_processes(trainer) // tp)
    return world if world > 1 else 0


def merge_engine_samples(shares: list[dict[str, np.ndarray]], flat: Sequence[int]) -> list[GeneratedSample]:
    """The vLLM engines' samples (each engine's first rank's, as JSON) back in the one-engine order:
    by place in ``flat`` (the one-engine call's prompt order), then sample index."""
    place = {position: k for k, position in enumerate(flat)}
    samples = [GeneratedSample(**s) for share in shares for s in json.loads(str(share["samples"]))]
    return sorted(samples, key=lambda s: (place[s.prompt_index], s.sample_index))


def merged_stats(shares: list[dict[str, np.ndarray]], batches: int) -> GenerationStats:
    """One rollout's stats from its ranks': tokens summed, seconds of the slowest (they ran side by side)."""
    return GenerationStats(generated_tokens=sum(int(s["generated_tokens"]) for s in shares),
                           seconds=max(float(s["seconds"]) for s in shares),
                           load_seconds=max(float(s["load_seconds"]) for s in shares), batches=batches)


def flatten(lists: Sequence[Sequence[float]]) -> tuple[np.ndarray, np.ndarray]:
    """(values, lengths): ragged float lists as one float32 array and their lengths (exact for
    values that came from float32 tensors)."""
    lengths = np.array([len(x) for x in lists], dtype=np.int64)
    flat = np.concatenate([np.asarray(x, dtype=np.float32) for x in lists]) if lists else np.zeros(0, np.float32)
    return flat, lengths


def unflatten(flat: np.ndarray, lengths: np.ndarray) -> list[list[float]]:
    ends = np.cumsum(lengths)
    return [flat[e - n:e].tolist() for e, n in zip(ends, lengths)]


def merge_shares(shares: list[dict[str, np.ndarray]], column: str, total: int) -> list[list[float]]:
    """Rank shares' ragged ``column`` back in table order (each share carries its rows, ``<column>_index``)."""
    out: list = [None] * total
    for share in shares:
        for i, values in zip(share[f"{column}_index"].tolist(), unflatten(share[column], share[f"{column}_lengths"])):
            out[i] = values
    missing = [i for i, v in enumerate(out) if v is None]
    if missing:
        raise RLHFError(f"the ranks returned no {column} for rows {missing[:5]} (of {total}); rerun the stage")
    return out


def write_share(out: Path, columns: dict[str, list], **scalars) -> None:
    """Each column's owned rows (``<name>_index``) as flat float32 values with their lengths."""
    arrays = {name: np.array(value) for name, value in scalars.items()}
    for name, column in columns.items():
        mine = [i for i, v in enumerate(column) if v is not None]
        arrays[f"{name}_index"] = np.array(mine, dtype=np.int64)
        arrays[name], arrays[f"{name}_lengths"] = flatten([_floats(column[i]) for i in mine])
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    atomic_write_bytes(out, buffer.getvalue())  # the parent reads only complete shares


def _floats(values) -> list[float]:
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)
