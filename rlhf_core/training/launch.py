"""Entry point of each data-parallel rank (started by torchrun or the deepspeed launcher):

    torchrun --standalone --nproc_per_node N -m rlhf_core.training.launch \
        --run-dir RUN --iteration K --config RUN/iter_K/.update_config.yaml

    torchrun --nnodes M --node_rank R --master_addr HOST --master_port PORT --rdzv_backend static ... \
        -m rlhf_core.training.launch ...          (one node of a multi-node update: training.nodes)

The parent (``rlhf stage update --nproc N``, on node 0) holds the run lock and records the stage;
the ranks only train and (rank 0) write the checkpoint and metrics; every rank writes its own
checkpoint shards into the run directory (with several nodes: shared storage). A user error exits
with status 2 and a one-line message, like the CLI; so does a full disk met outside the atomic
writers (a rank's own optimizer shard is written in place inside rank 0's temporary directory), which
the parent then reports as the stage's error instead of a generic "update on N ranks failed".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from rlhf_core.config import config_from_dict
from rlhf_core.config.loader import read_preset
from rlhf_core.errors import RLHFError, disk_full_as_user_error
from rlhf_core.run.layout import RunDir
from rlhf_core.training.distributed import shutdown_distributed
from rlhf_core.training.rank_update import train_update


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="rlhf_core.training.launch")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--iteration", type=int, required=True)
    parser.add_argument("--config", type=Path, required=True, help="resolved config YAML")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    args = parser.parse_args(argv)
    run = RunDir(args.run_dir)
    try:
        # outside the atomic writers a rank writes only its own checkpoint shard files
        with disk_full_as_user_error(run.checkpoint(args.iteration)):
            train_update(config_from_dict(read_preset(args.config)), run, args.iteration)
    except RLHFError as exc:
        return _user_error(exc)
    finally:
        shutdown_distributed()
    return 0


def _user_error(exc: RLHFError) -> int:
    """The one line the parent looks for (``training.nodes.USER_ERROR``) and raises as its own error."""
    print(f"rlhf: error: {exc}", file=sys.stderr, flush=True)
    return 2


if __name__ == "__main__":
    sys.exit(main())
