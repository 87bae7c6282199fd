"""RunLock across machines that share the run directory. A lock built with another ``host`` name
stands for a process on another machine: it locks its own host's kernel lock file, so the two see
only each other's lease, as two machines on shared storage do. A live lease refuses (naming the
holder, its host and how long ago it renewed), the heartbeat keeps a long holder's lease live, an
expired lease is taken over with an event (and the suspended holder learns it lost the run), and of
several machines racing for a free or an expired lease exactly one gets it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import rlhf_core
from rlhf_core.errors import RLHFError
from rlhf_core.run.layout import RunDir
from rlhf_core.run.lock import LEASE_ENV, Lease, RunLock, RunLockedError, lease_seconds, read_record

HOLD = r"""
import sys, time
from rlhf_core.run.layout import RunDir
from rlhf_core.run.lock import RunLock
lock = RunLock(RunDir(sys.argv[1]), host=sys.argv[2], lease_s=float(sys.argv[3])).acquire()
print("held", flush=True)
while not lock.lost:
    time.sleep(0.02)
print("lost", flush=True)
from rlhf_core.run.lifecycle import commit_iteration
from rlhf_core.run.lock import RunLockedError
try:
    commit_iteration(RunDir(sys.argv[1]), 1)
except RunLockedError:
    print("commit refused", flush=True)
time.sleep(120)
"""

# one machine per worker: each trial it races the others for one run directory's lock
RACER = r"""
import os, sys
from rlhf_core.run.layout import RunDir
from rlhf_core.run.lock import RunLock, RunLockedError

go, host = int(sys.argv[1]), sys.argv[2]
for line in sys.stdin:
    lock = RunLock(RunDir(line.strip()), host=host, lease_s=30)
    print("ready", flush=True)
    os.read(go, 1)
    try:
        lock.acquire()
    except RunLockedError:
        print("refused", flush=True)
        continue
    except Exception as exc:
        print(f"error {type(exc).__name__}: {exc}".replace("\n", " "), flush=True)
        continue
    print("held", flush=True)
    assert sys.stdin.readline().strip() == "release"
    lock.release()
    print("released", flush=True)
"""

LEASE_S = 2.0  # the other machine's lease: short, so that expiry fits in a test


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(Path(rlhf_core.__file__).resolve().parents[1])}


def _hold_on(run: RunDir, host: str, lease_s: float = LEASE_S) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run.root), host, str(lease_s)],
                            stdout=subprocess.PIPE, text=True, env=_env())
    assert proc.stdout.readline().strip() == "held"
    return proc


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGCONT)
    proc.kill()
    proc.wait()


def test_live_lease_of_another_host_refuses_and_the_heartbeat_keeps_it_live(tmp_path):
    run = RunDir(tmp_path / "run")
    proc = _hold_on(run, "node-b")
    try:
        here = RunLock(run, host="node-a")
        first = read_record(run.lock_path)
        assert first["host"] == "node-b" and first["pid"] == proc.pid and first["expires_after_s"] == LEASE_S
        time.sleep(2.5 * LEASE_S)  # more than two expiry periods: only renewals keep it live
        assert here.is_locked()
        with pytest.raises(RunLockedError) as err:
            here.acquire()
        message = str(err.value)
        assert f"pid {proc.pid} on node-b" in message and "lease was renewed" in message
        assert "stop it on node-b" in message and str(run.root) in message
        renewed = read_record(run.lock_path)["renewed"]
        assert renewed > first["renewed"] + 2 * LEASE_S and time.time() - renewed < LEASE_S
        assert not here.held and not any(e["kind"] == "stale_lease_taken_over" for e in run.events())
    finally:
        _stop(proc)


def test_expired_lease_is_taken_over_with_an_event_and_its_holder_learns_it_lost(tmp_path):
    run = RunDir(tmp_path / "run")
    proc = _hold_on(run, "node-b")
    try:
        proc.send_signal(signal.SIGSTOP)  # a hung machine: alive, holding, no longer renewing
        with pytest.raises(RunLockedError, match="on node-b"):
            RunLock(run, host="node-a").acquire()  # not expired yet
        time.sleep(1.5 * LEASE_S)
        lock = RunLock(run, host="node-a", lease_s=LEASE_S).acquire()
        (event,) = [e for e in run.events() if e["kind"] == "stale_lease_taken_over"]
        assert event["previous_holder"]["pid"] == proc.pid and event["previous_holder"]["host"] == "node-b"
        assert event["renewed_ago_s"] > LEASE_S and "token" not in event["previous_holder"]
        assert read_record(run.lock_path)["host"] == "node-a"
        proc.send_signal(signal.SIGCONT)  # its next renewal finds someone else's lease
        assert proc.stdout.readline().strip() == "lost"
        assert proc.stdout.readline().strip() == "commit refused"  # it stops writing the run
        (lost,) = [e for e in run.events() if e["kind"] == "lease_lost"]
        assert lost["pid"] == proc.pid and lost["taken_by"]["host"] == "node-a"
        time.sleep(LEASE_S)
        assert read_record(run.lock_path)["host"] == "node-a", "the loser must stop renewing"
        lock.release()
        assert not run.lock_path.exists()
    finally:
        _stop(proc)


def test_killed_holder_on_this_host_is_cleared_at_once_even_with_a_long_lease(tmp_path):
    run = RunDir(tmp_path / "run")
    proc = _hold_on(run, "node-a", lease_s=600)
    proc.kill()  # kill -9: its lease stays, but so does nothing of its kernel lock
    proc.wait()
    with pytest.raises(RunLockedError, match="on node-a"):
        RunLock(run, host="node-b").acquire()  # another machine must wait out the lease
    with RunLock(run, host="node-a"):  # this machine knows at once: it holds node-a's kernel lock
        pass
    (event,) = [e for e in run.events() if e["kind"] == "stale_lock_cleared"]
    assert event["previous_holder"]["pid"] == proc.pid


class Racers:
    """One long-lived process per host name, all released by the same start-gun pipe."""

    def __init__(self, hosts: list[str]):
        self.go_read, self.go_write = os.pipe()
        self.procs = [subprocess.Popen([sys.executable, "-c", RACER, str(self.go_read), host], env=_env(),
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                       pass_fds=(self.go_read,)) for host in hosts]

    def trial(self, run_dir: Path) -> list[str]:
        for p in self.procs:
            p.stdin.write(f"{run_dir}\n")
            p.stdin.flush()
        for p in self.procs:
            assert p.stdout.readline().strip() == "ready"
        os.write(self.go_write, b"x" * len(self.procs))
        answers = [p.stdout.readline().strip() for p in self.procs]
        for p, answer in zip(self.procs, answers):
            if answer == "held":  # every answer is in: only now may the holder let go
                p.stdin.write("release\n")
                p.stdin.flush()
                assert p.stdout.readline().strip() == "released"
        return answers

    def close(self) -> None:
        for p in self.procs:
            p.stdin.close()
        for p in self.procs:
            p.wait(timeout=30)
        os.close(self.go_read)
        os.close(self.go_write)


def _expired_lease(run_dir: Path) -> None:
    run_dir.mkdir(parents=True)
    old = time.time() - 120
    (run_dir / "run.lock").write_text(json.dumps({"pid": 1, "host": "node-gone", "since": old, "renewed": old,
                                                  "expires_after_s": 30, "token": "gone"}))


def test_machines_racing_for_a_free_or_an_expired_lease_exactly_one_wins(tmp_path):
    racers = Racers([f"node-{i}" for i in range(4)])
    trials = 60
    try:
        answers = []
        for t in range(trials):
            if t % 2:
                _expired_lease(tmp_path / f"trial_{t}")
            answers.append(racers.trial(tmp_path / f"trial_{t}"))
    finally:
        racers.close()
    holders = [a.count("held") for a in answers]
    errors = sorted({x for a in answers for x in a if x.startswith("error")})
    assert holders == [1] * trials, f"holders per trial {holders}; errors {errors}"
    for t in range(1, trials, 2):  # each expired lease was taken over once, with its event
        kinds = [e["kind"] for e in RunDir(tmp_path / f"trial_{t}").events()]
        assert kinds.count("stale_lease_taken_over") == 1
    assert not list(tmp_path.glob("trial_*/run.lock*")), "every winner released lease and kernel lock"


def test_a_taker_that_judged_an_old_copy_never_removes_the_new_holders_lease(tmp_path):
    """The interleaving a race rarely hits, in order: B reads the expired lease, A clears it and
    creates its own, then B (still holding its old view) tries to clear "the expired lease"."""
    _expired_lease(tmp_path / "run")
    path = tmp_path / "run" / "run.lock"
    seen_by_b = read_record(path)
    a, b = Lease(path, "node-a", 30), Lease(path, "node-b", 30)
    assert a.clear_stale(read_record(path)) and a.create()
    assert not b.clear_stale(seen_by_b), "B moved A's live lease"
    assert read_record(path)["token"] == a.token and not b.create()
    assert a.renew() and not b.renew()  # only the holder renews; the other learns it holds nothing
    assert sorted(p.name for p in path.parent.iterdir()) == ["run.lock"], "no stale or staged file left"


def test_lease_expiry_comes_from_the_argument_or_the_environment(monkeypatch):
    monkeypatch.delenv(LEASE_ENV, raising=False)
    assert lease_seconds() == 30.0 and lease_seconds(5) == 5.0
    monkeypatch.setenv(LEASE_ENV, "45")
    assert lease_seconds() == 45.0 and lease_seconds(2) == 2.0
    monkeypatch.setenv(LEASE_ENV, "soon")
    with pytest.raises(RLHFError, match=rf"\${LEASE_ENV}='soon' is not a number"):
        lease_seconds()
    with pytest.raises(RLHFError, match="lease_s=0 must be a positive"):
        lease_seconds(0)


@pytest.mark.parametrize("damage", [b"\xff\xfe\x00 not utf-8", b"{torn", b"[1, 2]", b'{"renewed": "soon", "host": "x"}',
                                    b'{"renewed": true, "host": "x"}'],
                         ids=["bytes", "torn", "list", "text_time", "bool_time"])
def test_a_damaged_lease_is_an_unknown_holder_taken_over_once_expired(tmp_path, damage):
    """Issue 38: a run.lock of bytes that are not UTF-8 raised UnicodeDecodeError out of every
    writing command. Any lease that does not read as a record is an unknown holder that renewed when
    the file was last written: refused in one line saying when it lapses, taken over after that."""
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    run.lock_path.write_bytes(damage)
    record = read_record(run.lock_path)
    assert record["unreadable"] is True and record["host"] is None
    assert record["renewed"] == run.lock_path.stat().st_mtime
    with pytest.raises(RunLockedError, match=rf"its lease {run.lock_path} is unreadable \(damaged, or another "
                                             r"machine's lease still being written\) .* taken over once 30 s old: "
                                             r"try again in \d+ s"):
        RunLock(run, lease_s=30).acquire()
    old = time.time() - 31
    os.utime(run.lock_path, (old, old))
    with RunLock(run, lease_s=30):
        assert read_record(run.lock_path)["pid"] == os.getpid()
    (event,) = [e for e in run.events() if e["kind"] == "stale_lease_taken_over"]
    assert event["previous_holder"] == {"host": None, "pid": None, "renewed": old, "unreadable": True}
    assert not run.lock_path.exists()


def test_a_lease_deleted_under_its_holder_is_said_as_deleted_not_taken_over(tmp_path):
    """Issue 49, 11: a lock file deleted under a live run made it say the run directory "was taken
    over by another process" — nobody took it. It says the file was deleted now, and how to go on."""
    run = RunDir(tmp_path / "run")
    lock = RunLock(run, host="node-a", lease_s=LEASE_S).acquire()
    try:
        run.lock_path.unlink()
        deadline = time.monotonic() + 5 * LEASE_S
        while not lock.lost and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(RunLockedError, match=rf"its lease {run.lock_path} was deleted while this process held "
                                                 rf"it, so another could start on the run; .*rlhf run --resume"):
            lock.ensure_held()
    finally:
        lock.release()
