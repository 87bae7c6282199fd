"""One writer per run directory: a second one refuses naming the holder; a dead holder's lock is
released by the kernel (the next writer proceeds and logs it); the lock is re-entrant in one process."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from rlhf_core.run.layout import RunDir
from rlhf_core.run.lock import RunLock, RunLockedError

HOLD = """
import sys, time
from rlhf_core.run.layout import RunDir
from rlhf_core.run.lock import RunLock
lock = RunLock(RunDir(sys.argv[1])).acquire()
print("held", flush=True)
time.sleep(60)
"""

# another process's attempt: prints "acquired" or "locked" (a lock held here must refuse it)
TRY = """
import sys
from rlhf_core.run.layout import RunDir
from rlhf_core.run.lock import RunLock, RunLockedError
try:
    RunLock(RunDir(sys.argv[1])).acquire().release()
    print("acquired")
except RunLockedError:
    print("locked")
"""


def _hold(path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLD), str(path)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def _other_process_tries(path) -> str:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(TRY), str(path)], capture_output=True,
                          text=True, check=True, timeout=120).stdout.strip()


def test_second_writer_refuses_naming_holder(tmp_path):
    proc = _hold(tmp_path)
    try:
        lock = RunLock(RunDir(tmp_path))
        assert lock.is_locked()
        with pytest.raises(RunLockedError) as err:
            lock.acquire()
        assert f"pid {proc.pid} on {socket.gethostname()}" in str(err.value)
        assert str(tmp_path.resolve()) in str(err.value)
        assert not lock.held
    finally:
        proc.kill()
        proc.wait()


def test_killed_holder_releases_the_lock_and_the_next_writer_logs_it(tmp_path):
    proc = _hold(tmp_path)
    proc.send_signal(signal.SIGKILL)  # no release runs: the kernel drops the flock with the process
    proc.wait()
    run = RunDir(tmp_path)
    assert not RunLock(run).is_locked()
    lock = RunLock(run).acquire()
    assert lock.held
    cleared = [e for e in run.events() if e["kind"] == "stale_lock_cleared"]
    assert len(cleared) == 1 and cleared[0]["previous_holder"]["pid"] == proc.pid
    lock.release()
    # a holder that released on purpose leaves no stale lock: the next acquire logs nothing
    RunLock(run).acquire().release()
    assert len([e for e in run.events() if e["kind"] == "stale_lock_cleared"]) == 1


def test_reentrant_in_one_process(tmp_path):
    run = RunDir(tmp_path)
    with RunLock(run):
        with RunLock(run):
            pass
        assert _other_process_tries(tmp_path) == "locked", "inner release must not drop the outer lock"
    assert not RunLock(run).is_locked()
    assert _other_process_tries(tmp_path) == "acquired"
