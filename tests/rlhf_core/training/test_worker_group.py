"""The worker group's command channel (``training.worker_group``) with two real torchrun ranks: every
rank answers every command in rank order; a rank's user error comes back as its one line, a bug
with its traceback, a rank that dies as an error naming the exit — each ending the group, never a
hang; and ranks whose coordinator was killed leave by themselves."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from rlhf_core.errors import RLHFError
from rlhf_core.training.worker_group import RankFailure, WorkerGroup

WORKER = str(Path(__file__).with_name("group_echo_worker.py"))


@pytest.fixture
def group(subprocess_env, monkeypatch):
    for key, value in subprocess_env().items():  # the ranks must not join an earlier test's world
        monkeypatch.setenv(key, value)
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    started = WorkerGroup(WORKER, 2, what="test group")
    yield started
    started.kill()


def test_every_rank_answers_every_command_in_rank_order(group):
    for value in range(20):
        replies = group.call("echo", value=value)
        assert [(r["rank"], r["value"]) for r in replies] == [(0, value), (1, value)]
    assert len({r["pid"] for r in replies}) == 2  # one process per rank, the same ones throughout
    group.close("close")
    assert not group.alive


def test_a_user_error_on_one_rank_comes_back_as_its_line_and_ends_the_group(group):
    with pytest.raises(RankFailure) as caught:
        group.call("user_error", rank=1, why="the data file is gone")
    assert (caught.value.rank, caught.value.user_error, str(caught.value)) == (1, True, "rank 1 says the data file is gone")
    assert not group.alive
    with pytest.raises(RLHFError, match="stopped after an earlier failure"):
        group.call("echo", value=1)


def test_a_failed_rank_is_reported_while_the_others_still_wait_for_it(group):
    started = time.monotonic()
    with pytest.raises(RankFailure, match="rank 0 says gone"):
        group.call("user_error", rank=0, why="gone", others_hang=True)
    assert time.monotonic() - started < 60  # not the other rank's hour: it was killed
    assert group._ranks.poll() is not None


def test_a_bug_comes_back_with_its_traceback(group):
    with pytest.raises(RankFailure) as caught:
        group.call("bug", rank=0, why="0/0")
    assert not caught.value.user_error and "ZeroDivisionError: rank 0 says 0/0" in str(caught.value)
    assert "Traceback" in str(caught.value)


def test_a_rank_that_dies_is_an_error_not_a_hang(group):
    started = time.monotonic()
    with pytest.raises(RLHFError, match=r"ended during 'exit'"):
        group.call("exit", rank=1)
    assert time.monotonic() - started < 120 and not group.alive


def test_a_killed_rank_is_one_line_naming_the_cause_and_the_log(subprocess_env, monkeypatch, tmp_path, capfd):
    """Issue 29: a killed rank's error carried torchrun's whole failure dump (~40 lines, twice on
    the console). Now one line: the root cause torchrun names, and the log with the rest; on the
    quiet console of `rlhf run` (TQDM_DISABLE) the dump is not passed through either."""
    for key, value in {**subprocess_env(), "TQDM_DISABLE": "1"}.items():
        monkeypatch.setenv(key, value)
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    log = tmp_path / "logs" / "group.log"
    group = WorkerGroup(WORKER, 2, what="test group", log=log)
    try:
        with pytest.raises(RLHFError) as caught:
            group.call("killed", rank=1)
    finally:
        group.kill()
    message = str(caught.value)
    assert "\n" not in message and message.startswith("the test group (ended during 'killed') failed"), message
    assert "rank 1 (local_rank: 1) exited with -9" in message and "Signal 9 (SIGKILL)" in message, message
    assert message.endswith(f"torchrun's whole output: {log}") and "Root Cause" in log.read_text()
    assert "Root Cause" not in capfd.readouterr().err


COORDINATOR = f"""
import json, os, sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[3])!r})
from rlhf_core.training.worker_group import WorkerGroup
group = WorkerGroup({WORKER!r}, 2)
print(json.dumps([r["pid"] for r in group.call("echo", value=0)]), flush=True)
os._exit(0)  # as a kill -9 would: no close, no clean-up
"""


def test_ranks_leave_when_their_coordinator_is_killed(subprocess_env):
    env = {k: v for k, v in subprocess_env().items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", COORDINATOR], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    pids = json.loads(out.stdout.strip().splitlines()[-1])
    deadline = time.monotonic() + 60
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, f"ranks {pids} still running 60 s after their coordinator died"
        time.sleep(0.2)
