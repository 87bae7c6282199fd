"""One writer per run directory, through the real `rlhf` command line (``--local``: no Prefect server).

- A second `rlhf stage preprocess` on a directory another process holds refuses at once: exit code
  2, one line on stderr naming the holder's pid, no traceback, nothing written.
- Two `rlhf stage preprocess` processes at once: the first is frozen (SIGSTOP) while it holds the
  lock, so the overlap is certain rather than a race; the second refuses naming it; the first, resumed,
  finishes its tables.
- A holder killed with SIGKILL leaves its lock file behind (the kernel lock dies with it); the next
  command takes the lock, records a ``stale_lock_cleared`` event naming the dead pid, and runs.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rlhf_core.run.layout import RunDir

HOLD = """
import sys, time
from rlhf_core.run.layout import RunDir
from rlhf_core.run.lock import RunLock
RunLock(RunDir(sys.argv[1])).acquire()
print("held", flush=True)
time.sleep(600)
"""
TIMEOUT = 300  # a hang guard only: refusing "at once" means without waiting for the holder


def rlhf_command() -> list[str]:
    script = Path(sys.executable).parent / "rlhf"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "rlhf_cli.main"]


def preprocess_args(run_dir: Path, raw: Path, model: Path) -> list[str]:
    return [*rlhf_command(), "stage", "preprocess", "--local", "--run-dir", str(run_dir),
            f"data.train_files=[{raw}]", "data.val_fraction=0.0", f"actor_rollout_ref.model.path={model}"]


@pytest.fixture
def raw_file(tmp_path, repo_root) -> Path:
    raw = tmp_path / "arith.jsonl"
    raw.write_text("".join((repo_root / "data/arith/train.jsonl").read_text().splitlines(True)[:8]))
    return raw


def assert_refused_naming(proc: subprocess.CompletedProcess, pid: int, run_dir: Path) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    assert lines[0].startswith("rlhf: error: run directory") and f"locked by pid {pid} " in lines[0]
    assert str(run_dir) in lines[0] and "released the moment that process exits" in lines[0]


def wait_for_lock(run: RunDir, pid: int, proc: subprocess.Popen) -> None:
    """Poll until ``pid`` holds the lock (the CLI takes it after parsing its config)."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        try:
            if json.loads(run.lock_path.read_text()).get("pid") == pid:
                return
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        assert proc.poll() is None, f"the first command ended before taking the lock: {proc.communicate()}"
        time.sleep(0.002)
    raise AssertionError("the first command never took the lock")


def test_second_command_refuses_while_another_process_holds_the_lock(tmp_path, raw_file, tiny_model_dir):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLD), str(run_dir)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        second = subprocess.run(preprocess_args(run_dir, raw_file, tiny_model_dir), capture_output=True,
                                text=True, timeout=TIMEOUT)
        assert_refused_naming(second, holder.pid, run_dir)
        assert not RunDir(run_dir).train_prompts.exists() and not RunDir(run_dir).rejects.exists()
        assert holder.poll() is None, "the holder must be untouched"
        assert json.loads(RunDir(run_dir).lock_path.read_text())["pid"] == holder.pid
    finally:
        holder.kill()
        holder.wait()


def test_two_preprocess_commands_at_once(tmp_path, raw_file, tiny_model_dir):
    run_dir = tmp_path / "run"
    run = RunDir(run_dir)
    first = subprocess.Popen(preprocess_args(run_dir, raw_file, tiny_model_dir), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        wait_for_lock(run, first.pid, first)
        first.send_signal(signal.SIGSTOP)  # frozen while holding the lock: the overlap is certain
        second = subprocess.run(preprocess_args(run_dir, raw_file, tiny_model_dir), capture_output=True,
                                text=True, timeout=TIMEOUT)
        assert_refused_naming(second, first.pid, run_dir)
        first.send_signal(signal.SIGCONT)
        out, err = first.communicate(timeout=TIMEOUT)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, err
    assert pq.read_table(run.train_prompts).num_rows == 8
    assert not run.lock_path.exists(), "the finished command releases its lock"


def test_stale_lock_of_a_killed_command_is_cleared_with_an_event(tmp_path, raw_file, tiny_model_dir):
    run_dir = tmp_path / "run"
    run = RunDir(run_dir)
    first = subprocess.Popen(preprocess_args(run_dir, raw_file, tiny_model_dir), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    wait_for_lock(run, first.pid, first)
    first.send_signal(signal.SIGSTOP)  # stop it holding the lock, then kill it there: no cleanup runs
    first.kill()
    first.wait()
    assert json.loads(run.lock_path.read_text())["pid"] == first.pid, "SIGKILL leaves the lock behind"

    again = subprocess.run(preprocess_args(run_dir, raw_file, tiny_model_dir), capture_output=True, text=True,
                           timeout=TIMEOUT)
    assert again.returncode == 0, again.stderr
    cleared = [e for e in run.events() if e["kind"] == "stale_lock_cleared"]
    assert len(cleared) == 1 and cleared[0]["previous_holder"]["pid"] == first.pid
    assert pq.read_table(run.train_prompts).num_rows == 8 and not run.lock_path.exists()


def test_lock_of_a_live_holder_is_never_treated_as_stale(tmp_path, raw_file, tiny_model_dir):
    """The stale check must not clear a lock whose holder is alive but busy (here: stopped)."""
    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLD), str(run_dir)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        holder.send_signal(signal.SIGSTOP)
        second = subprocess.run(preprocess_args(run_dir, raw_file, tiny_model_dir), capture_output=True,
                                text=True, timeout=TIMEOUT)
        assert_refused_naming(second, holder.pid, run_dir)
        assert not any(e["kind"] == "stale_lock_cleared" for e in RunDir(run_dir).events())
    finally:
        holder.kill()
        holder.wait()

