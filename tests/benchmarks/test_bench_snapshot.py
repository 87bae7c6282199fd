"""benchmarks/bench_snapshot.py as a CPU dry run at the smallest shape (one layer, ZeRO-0, one round):
every method measured side by side, the table with its exactness columns printed, and our snapshot
exact (what the benchmark's comparison of the libraries rests on)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]


def test_bench_snapshot_dry_run_prints_every_method_and_ours_is_exact(tmp_path, subprocess_env):
    out = tmp_path / "snapshot.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_snapshot.py"), "--layers", "1", "--stages", "0",
         "--repeat", "1", "--tokens", "8", "--scratch", str(tmp_path), "--model-cache", str(tmp_path / "models"),
         "--json", str(out)],
        cwd=REPO, env=subprocess_env(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false"), capture_output=True,
        text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    assert "| ZeRO | method | take s | restore s |" in text
    assert "exact after restore" in text and "next step identical" in text and "RNG back" in text
    rows = {line.split("|")[2].strip(): line for line in text.splitlines() if line.startswith("| 0 |")}
    assert set(rows) == {"ours", "ours-reuse", "deepspeed", "dcp"}, text
    for method in ("ours", "ours-reuse"):
        cells = [c.strip() for c in rows[method].split("|")]
        assert cells[-4:-1] == ["yes", "yes", "yes"], rows[method]  # exact, next step, RNG
    report = json.loads(out.read_text())["stages"]["0"][0]["methods"]
    for method in ("ours", "ours-reuse"):
        (run,) = report[method]
        assert not any(run["exact"].values()) and not any(run["next_step"].values()), run
        assert all(run["step_moved"][part] > 0 for part in ("params", "master", "moments", "adam_step"))
    assert all(report[m][0]["take"]["seconds"] > 0 for m in report if "error" not in report[m][0])
