"""Run by torchrun from test_worker_group.py (not collected): a worker-group rank whose commands
echo, fail as a user would, fail as a bug would, or end the process."""

from __future__ import annotations

import argparse
import os
import signal
import time

from rlhf_core.errors import RLHFError
from rlhf_core.training.worker_group import serve


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])

    def fail_on(command: dict, error: type) -> None:
        if rank == command["rank"]:
            raise error(f"rank {rank} says {command['why']}")
        if command.get("others_hang"):  # as a rank waiting in a collective for the failed one would
            time.sleep(3600)

    handlers = {
        "echo": lambda c: {"rank": rank, "value": c["value"], "pid": os.getpid()},
        "user_error": lambda c: fail_on(c, RLHFError),
        "bug": lambda c: fail_on(c, ZeroDivisionError),
        "exit": lambda c: os._exit(3) if rank == c["rank"] else None,
        "killed": lambda c: os.kill(os.getpid(), signal.SIGKILL) if rank == c["rank"] else None,
        "close": lambda c: None,
    }
    serve(args.store, rank, handlers, last="close", user_errors=(RLHFError,))


if __name__ == "__main__":
    main()
