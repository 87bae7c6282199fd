"""One writer per run directory: a second one refuses naming the holder; stale locks are cleared."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap

import pytest

from rlhf_core.run.layout import RunDir
from rlhf_core.run.lock import RunLock, RunLockedError

HOLD = """
import sys, time
from rlhf_core.run.layout import RunDir, RunLock
lock = RunLock(RunDir(sys.argv[1])).acquire()
print("held", flush=True)
time.sleep(60)
"""


def test_second_writer_refuses_naming_holder(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLD), str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(RunLockedError) as err:
            RunLock(RunDir(tmp_path)).acquire()
        assert f"pid {proc.pid}" in str(err.value)
        assert "run.lock" in str(err.value)
    finally:
        proc.kill()
        proc.wait()
    # the holder was SIGKILLed: its lock is stale and is cleared on the next acquire, with an event
    lock = RunLock(RunDir(tmp_path)).acquire()
    assert lock.held
    assert any(e["kind"] == "stale_lock_cleared" for e in RunDir(tmp_path).events())
    lock.release()
    assert not (tmp_path / "run.lock").exists()


def test_stale_lock_not_broken_when_asked(tmp_path):
    (tmp_path / "run.lock").write_text(json.dumps({"pid": 999999999, "host": socket.gethostname(), "since": 0}))
    with pytest.raises(RunLockedError):
        RunLock(RunDir(tmp_path)).acquire(break_stale=False)


def test_reentrant_in_one_process(tmp_path):
    run = RunDir(tmp_path)
    with RunLock(run):
        with RunLock(run):
            pass
        assert (tmp_path / "run.lock").exists(), "inner release must not drop the outer lock"
    assert not (tmp_path / "run.lock").exists()
