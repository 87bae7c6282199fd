"""Entry point of each process of a stage's model passes on several local processes (started by
``rlhf_core.stages.ranks.run_on_ranks`` under torchrun; see that module). Each process runs the
stage's share function (``stages.catalog.CATALOG[stage].share``), which its stage module holds. A user error exits with status 2 and a one-line message, like the CLI."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from rlhf_core.config import config_from_dict
from rlhf_core.config.loader import read_preset
from rlhf_core.io.allocator import keep_freed_memory
from rlhf_core.errors import RLHFError
from rlhf_core.run.layout import RunDir
from rlhf_core.stages.catalog import SHARED, stage_functions
from rlhf_core.run.session import RunSession

def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="rlhf_core.stages.rank_entry")
    parser.add_argument("stage", choices=SHARED)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--iteration", type=int, required=True)
    parser.add_argument("--config", type=Path, required=True, help="resolved config YAML")
    args = parser.parse_args(argv)
    keep_freed_memory()  # this rank's update and passes reuse freed pages (rlhf_core.io.allocator)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))  # "cuda" below = this rank's GPU
    run = RunDir(args.run_dir)
    try:
        # a process of its own for this stage: nothing in memory yet, every model read from disk
        stage_functions(args.stage).share(config_from_dict(read_preset(args.config)), run, args.iteration, rank,
                                          world, run.stage_rank_share(args.iteration, args.stage, rank), RunSession())
    except RLHFError as exc:
        print(f"rlhf: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
