"""`rlhf node join --run-dir RUN --node-rank R`: node R's part of every multi-node update of a run.

Started once on each node other than node 0 (trainer.nnodes > 1) and left running; it runs each
update node 0 requests through the run directory, which must be on storage every node sees at the
same path, and leaves when the run is finished or on Ctrl-C (``rlhf_core.training.nodes``).
"""

from __future__ import annotations

import argparse
import sys

from rlhf_core.run.layout import RunDir
from rlhf_core.training.nodes import join


def _say(line: str) -> None:
    print(f"rlhf: {line}", file=sys.stderr, flush=True)


def cmd_node(args: argparse.Namespace) -> int:
    """`rlhf node join`: serve this node's ranks until the run is finished."""
    return join(RunDir(args.run_dir), args.node_rank, _say)
