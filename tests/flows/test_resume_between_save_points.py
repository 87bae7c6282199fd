"""A run stopped between save points, through the `rlhf` console script: `rlhf status` says that
last-good's checkpoint is not written (only its record is), and the resume's validation of the
policy it continues from is recorded (iteration_metrics.json, `rlhf status`, `rlhf query`), not
only printed. The run is killed (SIGKILL) right after its first commit: Ctrl-C leaves the same
state when it lands between tasks, but one that lands inside a task can end in a write of the
committed state, so it would not make the state this test needs every time."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.prefect, pytest.mark.slow, pytest.mark.deepspeed]


def _env(home: Path, prefect_server: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["RLHF_HOME"], env["PREFECT_API_URL"] = str(home), prefect_server
    return env


def _rlhf() -> str:
    return shutil.which("rlhf", path=str(Path(sys.executable).parent)) or "rlhf"


def _killed_after_a_commit(tmp_path: Path, env: dict, args: list[str], run: Path) -> int:
    """Start `rlhf run`, kill it once an iteration is committed; returns last-good's iteration."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
    deadline = time.monotonic() + 300
    try:
        while not (run / "last_good.json").is_file():
            if proc.poll() is not None:
                pytest.fail(f"rlhf run ended (rc {proc.returncode}) before a commit:\n{proc.communicate()[1][-3000:]}")
            assert time.monotonic() < deadline, "no commit within 300 s"
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return json.loads((run / "last_good.json").read_text())["iteration"]


def test_status_and_the_resumes_validation_between_save_points(tmp_path, prefect_server, demo_preset, tiny_overrides,
                                                              repo_root):
    runs, env = tmp_path / "runs", _env(tmp_path / "home", prefect_server)
    run = runs / "cc"
    # validation every 10th step only, a checkpoint every 100th: iteration 1's state lives in memory; the
    # demo's shipped model with room for its answers, so the accuracy is not 0
    args = [_rlhf(), "run", "-c", demo_preset,
            *tiny_overrides(runs, "trainer.save_freq=100", "trainer.test_freq=10", f"actor_rollout_ref.model.path="
                            f"{repo_root / 'data' / 'models' / 'demo'}", "data.max_response_length=32",
                            "data.max_val_samples=32"),
            "--iterations", "50", "--run-name", "cc"]
    k = _killed_after_a_commit(tmp_path, env, args, run)
    assert not (run / f"iter_{k}" / "checkpoint" / "actor").exists()

    status = subprocess.run([_rlhf(), "status", str(run)], capture_output=True, text=True, env=env, timeout=300)
    assert status.returncode == 0, status.stderr[-3000:]
    line = next(x for x in status.stdout.splitlines() if x.startswith("last-good:"))
    assert line == f"last-good: iteration {k} (its checkpoint iter_{k}/checkpoint is not written: only its record " \
                   "is on disk)", status.stdout
    assert "a resume rebuilds it by replaying" in status.stdout  # the line after it, kept

    resumed = subprocess.run([_rlhf(), "run", "--resume", str(run), "--iterations", str(k + 1)], capture_output=True,
                             text=True, env=env, cwd=tmp_path, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    printed = next(x for x in resumed.stdout.splitlines() if x.startswith(f"resumed policy (iteration {k})"))
    # "resumed policy (iteration k): val/accuracy 0.512 [0.478, 0.547]": the accuracy, then its 95 % interval
    accuracy = float(printed.split("val/accuracy ", 1)[1].split()[0])
    recorded = json.loads((run / f"iter_{k}" / "iteration_metrics.json").read_text())
    assert f"{recorded['val/accuracy']:.3f}" == f"{accuracy:.3f}", recorded

    status = subprocess.run([_rlhf(), "status", str(run)], capture_output=True, text=True, env=env, timeout=300)
    lines = status.stdout.splitlines()
    header = next(x.split() for x in lines if x.startswith("iteration "))
    row = next(x.split() for x in lines if x.split()[:1] == [str(k)])
    assert float(row[header.index("val_acc")]) == pytest.approx(accuracy, abs=5e-4), status.stdout
    query = subprocess.run([_rlhf(), "query", str(run), f"SELECT round(value, 3) AS acc FROM metrics WHERE "
                            f"iteration = {k} AND name = 'val/accuracy'"], capture_output=True, text=True, env=env,
                           timeout=300)
    assert query.returncode == 0 and f"{accuracy:.3f}".rstrip("0") in query.stdout, query.stdout + query.stderr
