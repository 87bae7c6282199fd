"""What a first `rlhf run`, `rlhf stage` and `rlhf export` print (issue 43), through the console
script on a one-iteration tiny run: each thing said once, no library notices, no Prefect INFO lines
or progress bars where the run itself is quiet."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.prefect, pytest.mark.slow]

DEEPSPEED_NOTICE = "Setting accelerator to CPU"


def _rlhf(cwd: Path, home: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API") and k != "DS_ACCELERATOR"}
    env["RLHF_HOME"] = str(home)
    exe = shutil.which("rlhf", path=str(Path(sys.executable).parent)) or "rlhf"
    return subprocess.run([exe, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)


DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"


@pytest.fixture(scope="module")
def refused_run(tmp_path_factory, tiny_model_dir):
    """One iteration of the demo preset, shrunk, whose export is refused (the bar is above what the
    tiny model scores)."""
    tmp = tmp_path_factory.mktemp("quiet")
    overrides = [f"actor_rollout_ref.model.path={tiny_model_dir}", f"trainer.runs_root={tmp / 'runs'}",
                 "actor_rollout_ref.model.warm_start.enable=false", "data.train_batch_size=4", "data.max_val_samples=4",
                 "data.max_response_length=12", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "trainer.device=cpu",
                 "trainer.export_min_val_score=0.99"]
    proc = _rlhf(tmp, tmp / "home", "run", "-c", str(DEMO), *overrides, "--iterations", "1", "--run-name", "r")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, tmp / "runs" / "r", tmp


def test_a_refused_export_is_said_once_at_the_end_of_the_run(refused_run):
    proc, _, _ = refused_run
    both = proc.stdout + proc.stderr
    assert both.count("is below trainer.export_min_val_score=0.99") == 1, both[-3000:]
    assert "export: refusing to export" in proc.stdout  # in the closing block
    assert DEEPSPEED_NOTICE not in both


def test_a_stage_rerun_prints_its_result_not_the_task_log_or_bars(refused_run):
    _, run_dir, tmp = refused_run
    proc = _rlhf(tmp, tmp / "home", "stage", "update", "--run-dir", str(run_dir), "-k", "1", "--force")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[update iteration 1] done in" in proc.stdout
    assert "| INFO" not in proc.stderr and "%|" not in proc.stderr and DEEPSPEED_NOTICE not in proc.stderr, \
        proc.stderr[-3000:]


def test_export_loads_deepspeed_without_its_cpu_notice(refused_run):
    _, run_dir, tmp = refused_run
    proc = _rlhf(tmp, tmp / "home", "export", str(run_dir), "trainer.export_min_val_score=0", "--out",
                 str(tmp / "exported"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exported the last-good actor" in proc.stdout and DEEPSPEED_NOTICE not in proc.stderr, proc.stderr[-3000:]
