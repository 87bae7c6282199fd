"""`rlhf node join`: retired. A multi-node run's ranks are placed by a Ray cluster now
(``rlhf_core.training.ray_ranks``); the command answers with the steps that replace it."""

from __future__ import annotations

import argparse

from rlhf_core.config.verl_keys import RAY_STEPS
from rlhf_core.errors import RLHFError


def cmd_node(args: argparse.Namespace) -> int:
    raise RLHFError(f"`rlhf node join` is retired: {RAY_STEPS}; nothing runs on the other nodes but Ray")
