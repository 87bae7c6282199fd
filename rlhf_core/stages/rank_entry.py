"""Entry point of each process of a stage's model passes on several local processes (started by
``rlhf_core.stages.ranks.run_on_ranks`` under torchrun; see that module). A user error exits with
status 2 and a one-line message, like the CLI."""

from __future__ import annotations

import argparse
import dataclasses
import json
import io
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import pyarrow.parquet as pq
import torch

from rlhf_core.config import config_from_dict
from rlhf_core.config.loader import read_preset
from rlhf_core.errors import RLHFError
from rlhf_core.io.atomic import atomic_write_bytes
from rlhf_core.run.layout import RunDir
from rlhf_core.scoring import Throughput
from rlhf_core.rollout.generate import generate_responses, val_sampling_from_config
from rlhf_core.run.models import actor_path, reference_path
from rlhf_core.scoring.policy_kl import actor_ref_kl
from rlhf_core.stages import guard, rollout, score, validate
from rlhf_core.stages.ranks import flatten


def score_share(cfg, run: RunDir, iteration: int, rank: int, world: int, out: Path) -> None:
    """This rank's micro-batches of the score stage's model passes (old/ref log-probs, values)."""
    rows = pq.read_table(run.rollout(iteration), columns=["prompt_token_ids", "response_token_ids"]).to_pylist()
    meter = Throughput()
    passes = score.model_passes(cfg, score.model_paths(cfg, run, iteration), rows, meter, share=(rank, world))
    columns = {"old_log_probs": passes.old_log_probs, "ref_log_probs": passes.ref_log_probs, "values": passes.values}
    if passes.sum_pi_squared is not None:
        columns["sum_pi_squared"] = passes.sum_pi_squared
    _write_share(out, columns, ref_reused=passes.ref_reused, tokens=meter.tokens, seconds=meter.seconds)


def guard_share(cfg, run: RunDir, iteration: int, rank: int, world: int, out: Path) -> None:
    """This rank's micro-batches of the KL guard's measurement (exact per-token KL, sampled log-probs)."""
    sequences, prompt_lengths, _ = guard.load_scored_sequences(run.scored(iteration))
    kls, sampled = actor_ref_kl(cfg, run.checkpoint(iteration) / "actor", reference_path(cfg), sequences,
                                prompt_lengths, share=(rank, world))
    _write_share(out, {"kl": kls, "sampled": sampled})


def _write_share(out: Path, columns: dict[str, list], **scalars) -> None:
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


def rollout_share(cfg, run: RunDir, iteration: int, rank: int, world: int, out: Path) -> None:
    """This rank's generation batches of the rollout (HF engine), seeded as in one process."""
    _, _, batches, prompt_rows = rollout.iteration_prompts(run, iteration)
    samples, stats = generate_responses(cfg, actor_path(cfg, run, iteration), prompt_rows,
                                        rollout.iteration_sampling(cfg, iteration), batches,
                                        desc=f"rollout iter {iteration} rank {rank}", share=(rank, world))
    _write_share(out, {}, samples=json.dumps([dataclasses.asdict(s) for s in samples]),
                 generated_tokens=stats.generated_tokens, seconds=stats.seconds, load_seconds=stats.load_seconds)


def validate_share(cfg, run: RunDir, iteration: int, rank: int, world: int, out: Path) -> None:
    """This rank's generation batches of validation (HF engine), seeded as in one process."""
    _, samples = validate.sample_val_responses(cfg, run, validate.validation_actor(cfg, run, iteration),
                                               sampling=val_sampling_from_config(cfg, seed=0), share=(rank, world))
    _write_share(out, {}, samples=json.dumps([dataclasses.asdict(s) for s in samples]))


STAGES = {"score": score_share, "guard": guard_share, "rollout": rollout_share, "validate": validate_share}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="rlhf_core.stages.rank_entry")
    parser.add_argument("stage", choices=sorted(STAGES))
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--iteration", type=int, required=True)
    parser.add_argument("--config", type=Path, required=True, help="resolved config YAML")
    args = parser.parse_args(argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))  # "cuda" below = this rank's GPU
    run = RunDir(args.run_dir)
    try:
        STAGES[args.stage](config_from_dict(read_preset(args.config)), run, args.iteration, rank, world,
                           run.stage_rank_share(args.iteration, args.stage, rank))
    except RLHFError as exc:
        print(f"rlhf: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
