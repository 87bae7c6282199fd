"""The README's demo table is what the demo gives: its first columns (iterations 0 and 5) against
`rlhf demo --iterations 5` through the console script, on the shipped starting point
(data/models/demo). The PPO run is deterministic on a machine (the tiny model's work runs on one
thread); a CPU whose vector units make torch or MKL take other code paths may sum in another order
and drift from the table (README: "What to expect")."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.prefect, pytest.mark.slow, pytest.mark.deepspeed]

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_demo_table(text: str) -> dict[str, dict[int, str]]:
    """The first '| iteration | 0 | 5 | ...' table of the README: row label -> {iteration: cell}."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"^\| iteration \| 0 \|", line))
    iterations = [int(c) for c in _cells(lines[start])[1:]]
    table = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        label, *cells = _cells(line)
        table[label] = dict(zip(iterations, cells))
    return table


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_the_table_is_read_from_the_readme():
    table = readme_demo_table(README.read_text(encoding="utf-8"))
    assert set(table) == {"val accuracy", "KL per token"} and {0, 5, 30} <= set(table["val accuracy"])
    assert table["KL per token"][0] == "—"


def test_a_short_demo_gives_the_readmes_first_columns(tmp_path, prefect_server):
    table = readme_demo_table(README.read_text(encoding="utf-8"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["RLHF_HOME"], env["PREFECT_API_URL"] = str(tmp_path / "home"), prefect_server
    exe = shutil.which("rlhf", path=str(Path(sys.executable).parent)) or "rlhf"
    out = subprocess.run([exe, "demo", "--iterations", "5", "--run-name", "readme", f"trainer.runs_root={tmp_path}"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    # the closing block's MLflow command serves on one worker (its default four were killed by their
    # health check on a loaded laptop)
    assert "mlflow ui --host 127.0.0.1 --workers 1 --backend-store-uri sqlite:///" in out.stdout, out.stdout[-2000:]
    # "initial policy (iteration 0): val/accuracy 0.328 [0.253, 0.413]": the accuracy, then its 95 % interval
    initial = re.search(r"^initial policy \(iteration 0\): val/accuracy (\d\.\d{3}) \[\d\.\d{3}, \d\.\d{3}\]$",
                        out.stdout, re.MULTILINE)
    assert initial, out.stdout[-3000:]
    fifth = json.loads((tmp_path / "readme" / "iter_5" / "iteration_metrics.json").read_text())
    measured = {"val accuracy": {0: initial.group(1), 5: f"{fifth['val/accuracy']:.3f}"},
                "KL per token": {5: f"{fifth['kl/mean']:.3f}"}}
    expected = {row: {k: table[row][k] for k in cells} for row, cells in measured.items()}
    assert measured == expected, (f"README.md's demo table says {expected}, a 5-iteration demo here gives {measured}: "
                                  "measure the table again (a fresh `make demo`) if the training changed")
