"""benchmarks/bench_real_model.py as CPU dry runs on the tiny model: the logits table for both LM-head
modes, and a one-iteration run of the demo preset measured as a preset run is (memory budget, stages
against their floors, the accuracy lines), so the numbers docs/benchmarks.md §10 quotes cannot rot."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "bench_real_model.py"


def test_the_logits_table_measures_both_head_modes(tiny_model_dir, subprocess_env):
    proc = subprocess.run([sys.executable, str(SCRIPT), "logits", "--model", str(tiny_model_dir), "--sequences", "3",
                           "--prompt", "6", "--response", "10"], cwd=REPO, env=subprocess_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("log-probs", "exact KL"))]
    assert len(rows) == 4 and sum("row blocks" in r for r in rows) == 2 and sum("one call" in r for r in rows) == 2
    assert "one fp32 copy of the responses' logits" in proc.stdout


@pytest.mark.slow
@pytest.mark.prefect
def test_a_preset_run_is_measured_against_its_budget(tmp_path, subprocess_env):
    proc = subprocess.run([sys.executable, str(SCRIPT), "run", "--preset", "configs/demo.yaml", "--log",
                           str(tmp_path / "run.log"), "--iterations", "1", f"trainer.runs_root={tmp_path / 'runs'}",
                           "trainer.test_freq=1"],
                          cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "peak RSS of the process tree:" in out and "(budget 12 GiB: within)" in out, out
    stages = {line.split()[0] for line in out.splitlines() if line.split()[:1] and line.split()[0] in (
        "rollout", "score", "gae", "update", "guard", "validate")}
    assert stages == {"rollout", "score", "gae", "update", "guard", "validate"}, out
    assert "held-out accuracy (128 validation prompts; 95 % interval):" in out and "iteration 1" in out, out


def test_bad_arguments_are_one_line(subprocess_env):
    proc = subprocess.run([sys.executable, str(SCRIPT), "run", "--preset", "configs/none.yaml"], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].endswith("--preset configs/none.yaml: no such file")
