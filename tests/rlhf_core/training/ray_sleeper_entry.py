"""A worker-group entry for tests (tests/rlhf_core/training/test_ray_nodes.py): each rank writes its
pid to DIR/rank<R>.pid, then serves one command, "sleep", which sleeps for the seconds it is given."""

from __future__ import annotations

import argparse
import os
import time

from rlhf_core.errors import RLHFError
from rlhf_core.training.worker_group import serve


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("dir")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    with open(os.path.join(args.dir, f"rank{rank}.pid"), "w") as fh:
        fh.write(str(os.getpid()))
    serve(args.store, rank, {"sleep": lambda command: time.sleep(command["seconds"])}, last="sleep",
          user_errors=(RLHFError,))


if __name__ == "__main__":
    main()
