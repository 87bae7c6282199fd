"""Ctrl-C on `rlhf run`, through the real console script with its own temporary Prefect server:
one line saying how to resume, exit status 130, no traceback, no hang; then the resume runs."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.prefect, pytest.mark.slow, pytest.mark.deepspeed]


def _env(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}  # its own server
    env["RLHF_HOME"] = str(home)
    return env


def _rlhf() -> str:
    return shutil.which("rlhf", path=str(Path(sys.executable).parent)) or "rlhf"


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"rlhf run ended (rc {proc.returncode}) before {path} appeared:\n{err[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{path} did not appear within {timeout} s")
        time.sleep(0.5)


@pytest.mark.parametrize("whole_group", [True, False], ids=["terminal-ctrl-c", "sigint-to-rlhf-only"])
def test_ctrl_c_prints_the_resume_command_and_exits_130(tmp_path, demo_preset, tiny_overrides, whole_group):
    runs = tmp_path / "runs"
    args = [_rlhf(), "run", "-c", demo_preset, *tiny_overrides(runs), "--iterations", "50", "--run-name", "cc"]
    # a terminal's Ctrl-C reaches the whole foreground process group, the temporary server included
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            env=_env(tmp_path / "home"), start_new_session=True)
    _wait_for(runs / "cc" / "iter_1", proc, timeout=240)  # training has started
    os.killpg(proc.pid, signal.SIGINT) if whole_group else proc.send_signal(signal.SIGINT)
    started = time.monotonic()
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("rlhf run did not exit within 60 s of Ctrl-C")
    seconds = time.monotonic() - started
    assert proc.returncode == 130, err[-3000:]
    assert f"rlhf: interrupted; continue with: rlhf run --resume {runs / 'cc'}" in err
    assert "Traceback" not in err, err[-3000:]
    print(f"\n[timing] exit {seconds:.1f} s after Ctrl-C")
    resumed = subprocess.run([_rlhf(), "run", "--resume", str(runs / "cc"), "--iterations", "1"],
                             capture_output=True, text=True, cwd=tmp_path, env=_env(tmp_path / "home"), timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "last-good: iteration 1" in resumed.stdout
