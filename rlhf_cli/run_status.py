"""`rlhf status RUN`: a run's stage table, last-good iteration and problems (``rlhf_core.control.status``).
It reads the run's records and its config's data section only, so it imports no torch and answers in
about a second (``tests/rlhf_cli/test_light_commands.py``; a real model's run adds the hashing of its
checkpoints, which status verifies)."""

from __future__ import annotations

import argparse

from rlhf_core.control.status import format_status
from rlhf_core.run.layout import require_run_dir


def cmd_status(args: argparse.Namespace) -> int:

    require_run_dir(args.run_dir)
    print(format_status(args.run_dir))
    return 0
