"""RunLock under real contention: four processes acquire one run's lock at the same instant, 200
times; a holder killed with SIGKILL, or one that forked a child before dying, never blocks the run.

The workers are started once and driven over their stdin, so the 200 trials cost milliseconds each.
A trial: every worker opens the trial's (fresh) run directory, says it is ready, waits on one shared
pipe that the test writes four bytes to (the start gun), then tries to acquire and answers "held"
or "refused". A worker that holds keeps holding until every worker has answered, so the number of
"held" answers is the number of processes holding the lock at the same moment.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

import rlhf_core
from rlhf_core.run.layout import RunDir
from rlhf_core.run.lock import RunLock, RunLockedError

WORKERS = 4
TRIALS = 200

WORKER = r"""
import os, sys
from rlhf_core.run.layout import RunDir
from rlhf_core.run.lock import RunLock, RunLockedError

go = int(sys.argv[1])
for line in sys.stdin:
    run = RunDir(line.strip())
    print("ready", flush=True)
    os.read(go, 1)  # the start gun: every worker leaves this read within microseconds of the others
    lock = RunLock(run)
    try:
        lock.acquire()
    except RunLockedError:
        print("refused", flush=True)
        continue
    except Exception as exc:  # the old lock could fail in other ways under the race: count it, go on
        print(f"error {type(exc).__name__}: {exc}".replace("\n", " "), flush=True)
        continue
    print("held", flush=True)
    assert sys.stdin.readline().strip() == "release"
    lock.release()
    print("released", flush=True)
"""

HOLD_AND_FORK = r"""
import os, sys, time
from rlhf_core.run.layout import RunDir
from rlhf_core.run.lock import RunLock, RunLockedError

run = RunDir(sys.argv[1])
RunLock(run).acquire()
answer_read, answer_write = os.pipe()
child = os.fork()
if child == 0:  # a forked helper (a data loader, a launcher) is another process: it must not hold the lock
    try:
        RunLock(run).acquire()
        os.write(answer_write, b"child-held")
    except RunLockedError:
        os.write(answer_write, b"child-refused")
    time.sleep(120)
    os._exit(0)
print(f"held {child} {os.read(answer_read, 64).decode()}", flush=True)
time.sleep(120)
"""


def _env() -> dict:
    """The workers import the same rlhf_core as this test (the checkout under test)."""
    return {**os.environ, "PYTHONPATH": str(Path(rlhf_core.__file__).resolve().parents[1])}


class Workers:
    """WORKERS long-lived processes running WORKER, all reading the same start-gun pipe."""

    def __init__(self):
        self.go_read, self.go_write = os.pipe()
        self.procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(self.go_read)], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True, bufsize=1, env=_env(),
                                       pass_fds=(self.go_read,)) for _ in range(WORKERS)]

    def trial(self, run_dir: Path) -> list[str]:
        """One simultaneous acquisition; returns each worker's answer (held / refused / error ...)."""
        for p in self.procs:
            p.stdin.write(f"{run_dir}\n")
            p.stdin.flush()
        for p in self.procs:
            assert p.stdout.readline().strip() == "ready"
        os.write(self.go_write, b"x" * WORKERS)
        answers = [p.stdout.readline().strip() for p in self.procs]
        for p, answer in zip(self.procs, answers):
            if answer == "held":  # every answer is in: only now may a holder let go
                p.stdin.write("release\n")
                p.stdin.flush()
                assert p.stdout.readline().strip() == "released"
        return answers

    def close(self) -> None:
        for p in self.procs:
            p.stdin.close()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        os.close(self.go_read)
        os.close(self.go_write)


def test_four_processes_at_once_exactly_one_holds(tmp_path):
    workers = Workers()
    try:
        answers = [workers.trial(tmp_path / f"trial_{t}") for t in range(TRIALS)]
    finally:
        workers.close()
    holders = [a.count("held") for a in answers]
    errors = sorted({x for a in answers for x in a if x.startswith("error")})
    over = sum(h > 1 for h in holders)
    print(f"trials with more than one holder: {over}/{TRIALS}; with none: {holders.count(0)}/{TRIALS}")
    assert over == 0, f"{over}/{TRIALS} trials had more than one process holding the lock at once"
    assert holders == [1] * TRIALS, f"{holders.count(0)} trials had no holder at all; errors: {errors}"
    assert not errors
    # the loser's error is the one-line RunLockedError: a fresh try on a finished trial's directory works
    with RunLock(RunDir(tmp_path / "trial_0")):
        pass


def test_killed_holder_releases_the_lock_with_an_event(tmp_path):
    run = RunDir(tmp_path / "run")
    hold = "import sys, time\nfrom rlhf_core.run.layout import RunDir\nfrom rlhf_core.run.lock import RunLock\n" \
           "RunLock(RunDir(sys.argv[1])).acquire()\nprint('held', flush=True)\ntime.sleep(120)\n"
    proc = subprocess.Popen([sys.executable, "-c", hold, str(run.root)], stdout=subprocess.PIPE, text=True,
                            env=_env())
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(RunLockedError, match=f"pid {proc.pid}"):
            RunLock(run).acquire()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with RunLock(run) as lock:  # the kernel dropped the dead holder's lock: no waiting, no manual cleanup
        assert lock.held
    cleared = [e for e in run.events() if e["kind"] == "stale_lock_cleared"]
    assert len(cleared) == 1 and cleared[0]["previous_holder"]["pid"] == proc.pid


def test_a_forked_child_neither_shares_nor_keeps_the_lock(tmp_path):
    """The lock lives on an open file, which a fork copies: the child must not count as the holder
    (no re-entry), nor keep the run locked after the holder is killed."""
    run = RunDir(tmp_path / "run")
    proc = subprocess.Popen([sys.executable, "-c", HOLD_AND_FORK, str(run.root)], stdout=subprocess.PIPE,
                            text=True, env=_env())
    child = None
    try:
        held, child, answer = proc.stdout.readline().split()
        child = int(child)
        assert (held, answer) == ("held", "child-refused")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert psutil.pid_exists(child)  # the forked child lives on, with its copy of the holder's files
        with RunLock(run) as lock:  # the kernel lock went with the holder, whatever its child inherited
            assert lock.held
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if child is not None:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
