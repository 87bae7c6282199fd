"""Benchmark: how long `rlhf` takes to answer, command by command, beside Python's own floors.

Run from the repository root::

    python benchmarks/bench_cli_start.py --run runs/<a finished run>    # every command
    python benchmarks/bench_cli_start.py                                 # the commands that need no run
    python benchmarks/bench_cli_start.py --repeats 5 --json out.json

Each command runs as a user runs it (the installed console script, a fresh process, its output
discarded) ``--repeats`` times; the table shows the median and best wall time and the ratio of the
median to the goal (2 s for the read-only commands, 5 s for a refused `rlhf run`). Two floors are
measured in the same run: a bare interpreter, and `import torch` alone, which every command that
parses a config pays (the config's algorithm names are checked against registries that live with
the torch math). The refusals check that nothing is left behind: no run directory under the
benchmark's own runs root. Nothing here is a pass/fail test: it prints what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from arguments import existing_dir, output_file, at_least  # benchmarks/arguments.py: sys.path[0] is this folder

ROOT = Path(__file__).resolve().parents[1]
READ_GOAL, REFUSAL_GOAL = 2.0, 5.0


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=existing_dir, help="a run directory for `rlhf status` / `rlhf query`")
    parser.add_argument("--repeats", type=at_least(1), default=3)
    parser.add_argument("--json", type=output_file, help="also write the measurements here")
    args = parser.parse_args(argv)
    if args.run is not None and not (args.run / "config.yaml").is_file():
        parser.error(f"argument --run: {args.run} is not a run directory (no config.yaml); give one under runs/")
    return args


def rlhf() -> str:
    """The console script beside this interpreter, as `make install` puts it."""
    script = Path(sys.executable).parent / "rlhf"
    if not script.is_file():
        sys.exit(f"bench_cli_start: no rlhf console script beside {sys.executable}; run `make install` first")
    return str(script)


def cases(run: Path | None, scratch: Path) -> list[tuple[str, list[str], float]]:
    """(label, argv, goal seconds); the floors have no goal (0)."""
    empty = scratch / "empty.jsonl"
    empty.write_text("")
    runs_root = f"trainer.runs_root={scratch / 'runs'}"
    out = [
        ("python (bare interpreter)", [sys.executable, "-c", "pass"], 0.0),
        ("python -c 'import torch'", [sys.executable, "-c", "import torch"], 0.0),
        ("rlhf --help", [rlhf(), "--help"], READ_GOAL),
        ("rlhf status <not a run>", [rlhf(), "status", str(scratch / "nope")], READ_GOAL),
        ("rlhf run: a config mistake", [rlhf(), "run", "-c", "configs/demo.yaml", runs_root,
                                        "data.train_batch_size=abc"], REFUSAL_GOAL),
        ("rlhf run: an empty data file", [rlhf(), "run", "-c", "configs/demo.yaml", runs_root,
                                          f"data.train_files=[{empty}]"], REFUSAL_GOAL),
    ]
    if run is not None:
        out += [("rlhf status RUN", [rlhf(), "status", str(run)], READ_GOAL),
                ("rlhf query RUN (count metrics)", [rlhf(), "query", str(run), "SELECT count(*) FROM metrics"],
                 READ_GOAL)]
    return out


def timed(argv: list[str], repeats: int) -> tuple[list[float], int]:
    """Wall seconds of each run and the last exit status."""
    seconds, code = [], 0
    env = {**os.environ, "RLHF_HOME": os.environ.get("RLHF_HOME", str(ROOT / ".rlhf"))}
    for _ in range(repeats):
        start = time.perf_counter()
        code = subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
        seconds.append(time.perf_counter() - start)
    return seconds, code


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-cli-") as tmp:
        scratch = Path(tmp)
        for label, command, goal in cases(args.run, scratch):
            seconds, code = timed(command, args.repeats)
            rows.append({"command": label, "median_s": statistics.median(seconds), "best_s": min(seconds),
                         "exit": code, "goal_s": goal})
        left_behind = (scratch / "runs").exists() and any((scratch / "runs").iterdir())
    print(f"{'command':34} {'median':>8} {'best':>8} {'exit':>5} {'goal':>6} {'median/goal':>12}")
    for r in rows:
        ratio = f"{r['median_s'] / r['goal_s']:.2f}" if r["goal_s"] else "-"
        goal = f"{r['goal_s']:.0f} s" if r["goal_s"] else "-"
        print(f"{r['command']:34} {r['median_s']:7.2f}s {r['best_s']:7.2f}s {r['exit']:5d} {goal:>6} {ratio:>12}")
    print(f"refused runs left a run directory behind: {'yes' if left_behind else 'no'}")
    if not args.run:
        print("(no --run: `rlhf status RUN` and `rlhf query RUN` not measured)")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "left_behind": left_behind}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
