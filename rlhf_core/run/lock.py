"""The run directory's writer lock: at most one process writes a run, on one machine or on several
machines that share the run directory, and a dead holder never blocks it for long.

Two parts, taken in this order and released in the reverse one:

1. **The host's kernel lock** (``flock`` on ``run.lock.<host>``): it orders the processes of one
   machine. The kernel drops it the instant its holder dies, however it dies (kill -9 included), so
   on one host a lock is stale exactly when its holder is gone and nobody has to guess from a pid.
   Each host locks its own file: flock across machines (over NFS it is emulated with byte-range
   locks) is not something to rely on, and a pid means nothing on another host.
2. **The lease** (``run.lock``, JSON: holder host, pid, start time, last renewal, expiry): it orders
   the machines. It is created with the storage's own atomic create (a complete, fsynced private
   file hard-linked to ``run.lock``: the link fails if the name exists; ``O_CREAT|O_EXCL`` where the
   storage has no hard links), renewed by a background thread every ``lease_s / 6`` seconds (an
   atomic rename of a fresh record over it), and removed on release. A competitor refuses while the
   lease is live, naming the holder and how long ago it renewed. A lease is taken over only when

   - it names this host: whoever wrote it is dead, since we hold this host's kernel lock that every
     holder on this host holds (``stale_lock_cleared``: instant, as on one machine); or
   - it names another host and was last renewed more than its ``expires_after_s`` ago
     (``stale_lease_taken_over``). Takers go one at a time: each first creates
     ``run.lock.takeover`` with the same atomic create; the one that holds it re-reads the lease,
     removes it only if it still is the very record it judged stale (a holder that renewed in
     between keeps it) and lets go of ``run.lock.takeover``; it records the event, then creates
     its own lease like any first holder (a faster process may still win that). A taker that died
     holding ``run.lock.takeover`` blocks takeovers only until that file's own expiry.

   Expiry compares the holder's wall clock with the competitor's: the hosts' clocks must agree to
   well within the expiry (NTP does). A holder that could not renew in time (a suspended VM, a
   partition) and finds at its next renewal that its lease was taken over records ``lease_lost``
   and stops renewing; ``lost`` tells its code, and ``ensure_held`` raises.

The host name a lock records and compares is ``socket.gethostname()`` unless the ``host`` argument
names another: two locks with different host names behave exactly as processes on two machines
(neither sees the other's kernel lock), which is how the tests stand in for a second machine.
The expiry is ``lease_s``, else ``$RLHF_RUN_LEASE_S``, else 30 s.

Re-entrant within one process (the flow holds it and calls stages that take it again). A forked
child is another process: it inherits the holder's open lock file, and with it the kernel lock, so
the child closes its copies at once (``_forget_inherited``); otherwise a helper the holder forked
would keep the run locked after the holder died, and would count as the holder itself. (The
heartbeat thread does not exist in the child; the parent keeps renewing.)
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from rlhf_core.errors import RLHFError, require_writable
from rlhf_core.run.layout import RunDir

LEASE_ENV = "RLHF_RUN_LEASE_S"
"""Environment variable: seconds without renewal after which another host may take a lease over."""
DEFAULT_LEASE_S = 30.0
"""Long enough that a busy holder never misses it (it renews every 5 s), short enough that a run whose
machine died is free again within half a minute."""
RENEWALS_PER_LEASE = 6
"""The holder renews this many times per expiry period: five renewals may fail before it lapses."""


class RunLockedError(RLHFError, RuntimeError):
    """Another live process holds the run directory."""


def lease_seconds(value: Optional[float] = None) -> float:
    """The lease expiry in seconds: ``value``, else ``$RLHF_RUN_LEASE_S``, else 30."""
    source = "lease_s"
    if value is None:
        raw = os.environ.get(LEASE_ENV)
        if not raw:
            return DEFAULT_LEASE_S
        source = f"${LEASE_ENV}"
        try:
            value = float(raw)
        except ValueError:
            raise RLHFError(f"{source}={raw!r} is not a number of seconds; set it to e.g. 30 or unset it") from None
    if not value > 0:
        raise RLHFError(f"{source}={value!r} must be a positive number of seconds (e.g. 30)")
    return float(value)


def read_record(path: Path) -> Optional[dict]:
    """The lease record at ``path``; None when there is none. A record that does not parse (a lease
    written with O_EXCL and still being written, or damaged: any bytes, UTF-8 or not) reads as an
    unknown holder (``"unreadable": True``) that renewed at the file's modification time, so it
    expires like any other and is then taken over (``stale_lease_taken_over``)."""
    try:
        data = path.read_bytes()
        mtime = path.stat().st_mtime
    except FileNotFoundError:
        return None
    try:
        record = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        record = None
    if not isinstance(record, dict) or not _usable(record):
        return {"host": None, "pid": None, "renewed": mtime, "unreadable": True}
    record.setdefault("renewed", record.get("since", mtime))  # a lock file of an older version
    return record


def _usable(record: dict) -> bool:
    """Whether a parsed record's times are numbers (a damaged one's may be anything)."""
    return all(isinstance(record.get(key, 0.0), (int, float)) and not isinstance(record.get(key), bool)
               for key in ("renewed", "since", "expires_after_s"))


def renewed_ago(record: dict, now: Optional[float] = None) -> float:
    """Seconds since the holder last renewed (by the two hosts' wall clocks; negative = skew)."""
    return (time.time() if now is None else now) - float(record.get("renewed") or 0.0)


def is_expired(record: dict, default_lease_s: float, now: Optional[float] = None) -> bool:
    """Whether the holder has not renewed within the expiry it promised (its ``expires_after_s``)."""
    return renewed_ago(record, now) > float(record.get("expires_after_s") or default_lease_s)


def public(record: dict) -> dict:
    """The record without its token (events and errors name the holder, not its secret)."""
    return {k: v for k, v in record.items() if k != "token"}


class Lease:
    """This process's lease on ``path`` (``run.lock``): create, clear a stale one, renew, remove."""

    def __init__(self, path: Path, host: str, lease_s: float):
        self.path = path
        self.host = host
        self.lease_s = lease_s
        self.token = uuid.uuid4().hex
        self.since = time.time()
        self.lost = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def record(self) -> dict:
        return {"pid": os.getpid(), "host": self.host, "since": self.since, "renewed": time.time(),
                "expires_after_s": self.lease_s, "token": self.token}

    def _staged(self, record: dict) -> Path:
        """``record`` in a private file beside the lease, complete and on disk."""
        tmp = self.path.with_name(f"{self.path.name}.{self.token}.tmp")
        with open(tmp, "w") as fh:
            json.dump(record, fh)
            fh.flush()
            os.fsync(fh.fileno())
        return tmp

    def _create(self, path: Path, record: dict) -> bool:
        """Create ``path`` holding ``record`` if no file has that name (atomically); False if one has."""
        tmp = self._staged(record)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK):
                raise
            return self._create_exclusive(path, record)  # storage without hard links
        finally:
            os.unlink(tmp)
        return True

    @staticmethod
    def _create_exclusive(path: Path, record: dict) -> bool:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, json.dumps(record).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        return True

    def create(self) -> bool:
        """Create the lease if no lease exists (atomically); False when one does."""
        return self._create(self.path, self.record())

    @property
    def takeover_path(self) -> Path:
        """``run.lock.takeover``: held (created atomically) by the one process clearing a stale lease."""
        return self.path.with_name(f"{self.path.name}.takeover")

    def clear_stale(self, seen: dict) -> bool:
        """Remove the stale lease ``seen``; False when another process is clearing it or it changed
        since we judged it. Takers go one at a time through ``run.lock.takeover``: a lease is removed
        only by the taker holding it, and only while it still is the record judged stale, so no taker
        ever removes a lease created after the judgement (nothing else removes a lease it does not
        hold). Creating ours is a separate step, which another process may still win."""
        if not self._claim_takeover():
            return False
        try:
            if read_record(self.path) != seen:
                return False  # renewed, released or replaced since we judged it: judge again
            os.unlink(self.path)
            return True
        finally:
            current = read_record(self.takeover_path)
            if current and current.get("token") == self.token:
                os.unlink(self.takeover_path)

    def _claim_takeover(self) -> bool:
        claim = {"pid": os.getpid(), "host": self.host, "renewed": time.time(),
                 "expires_after_s": self.lease_s, "token": self.token}
        if self._create(self.takeover_path, claim):
            return True
        other = read_record(self.takeover_path)
        if other and is_expired(other, self.lease_s):
            # its taker died between claiming and finishing: remove that claim (if still that one)
            aside = self.takeover_path.with_name(f"{self.takeover_path.name}.{self.token}.stale")
            try:
                os.rename(self.takeover_path, aside)
            except FileNotFoundError:
                return False
            if read_record(aside) != other:  # a new claim replaced it meanwhile: put that back
                try:
                    os.link(aside, self.takeover_path)
                except FileExistsError:
                    pass
            os.unlink(aside)
        time.sleep(0.01)  # another taker is at work: give it the moment it needs, then judge again
        return False

    def renew(self) -> bool:
        """Write a fresh renewal time; False when the lease is no longer ours."""
        current = read_record(self.path)
        if not current or current.get("token") != self.token:
            return False
        os.replace(self._staged(self.record()), self.path)
        return True

    def start_heartbeat(self, on_lost: Callable[[], None]) -> None:
        self._thread = threading.Thread(target=self._beat, args=(on_lost,), daemon=True,
                                        name=f"run-lease-heartbeat:{self.path.parent.name}")
        self._thread.start()

    def _beat(self, on_lost: Callable[[], None]) -> None:
        while not self._stop.wait(self.lease_s / RENEWALS_PER_LEASE):
            try:
                if self.renew():
                    continue
            except OSError:
                continue  # a passing storage error: the lease has five more renewals of slack
            try:
                on_lost()
            finally:
                self.lost = True  # after the event: whoever sees ``lost`` also finds it recorded
            return

    def remove(self) -> None:
        """Stop renewing and remove the lease if it is still ours."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        current = read_record(self.path)
        if current and current.get("token") == self.token:
            os.unlink(self.path)


@dataclass
class _Hold:
    """What this process holds for one run: the host lock file, the re-entry depth, the lease."""
    fd: int
    depth: int
    lease: Lease


class RunLock:
    """Exclusive, re-entrant writer lock on a run directory (see the module docstring).

    ``host``: the machine name recorded in the lease and compared with a lease's host (default
    ``socket.gethostname()``); ``lease_s``: the expiry of this holder's lease in seconds (default
    ``$RLHF_RUN_LEASE_S``, else 30)."""

    _held: dict = {}  # run root → _Hold: one kernel lock and one lease per process and run

    def __init__(self, run: RunDir, host: Optional[str] = None, lease_s: Optional[float] = None):
        self.run = run
        self.host = host or socket.gethostname()
        self.lease_s = lease_seconds(lease_s)
        self.held = False
        self.outermost = False
        """Whether this acquire took the lock (not a re-entry of this process's own hold): only the
        outermost holder speaks for the run (e.g. marks earlier flow runs crashed)."""

    @property
    def lease_path(self) -> Path:
        return self.run.lock_path

    @property
    def host_lock_path(self) -> Path:
        """This host's kernel lock file, ``run.lock.<host>`` (host name made safe for a file name)."""
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", self.host)
        return self.run.lock_path.with_name(f"{self.run.lock_path.name}.{safe}")

    def holder(self) -> Optional[dict]:
        """The lease's holder (host, pid, since, renewed, expires_after_s); None when there is none."""
        record = read_record(self.lease_path)
        return public(record) if record else None

    @property
    def lost(self) -> bool:
        """Whether this process held the lease and another host took it over (see ``ensure_held``)."""
        hold = RunLock._held.get(self.run.root)
        return bool(hold and hold.lease.lost)

    def ensure_held(self) -> None:
        """Raise RunLockedError if this process's lease was taken over while it could not renew."""
        if self.lost:
            holder = self.holder()
            if holder is None:  # nobody took it: the file went (deleted by hand, a cleanup script)
                raise RunLockedError(f"run directory {self.run.root}: its lease {self.lease_path} was deleted while "
                                     "this process held it, so another could start on the run; stopped here to keep "
                                     f"one writer: `rlhf run --resume {self.run.root}` continues it")
            raise RunLockedError(f"run directory {self.run.root} was taken over by {self._who(holder)} "
                                 f"after this process missed its lease renewals; stop writing to it")

    def is_locked(self) -> bool:
        """Whether some process holds the lock now (ours included): this host's kernel lock is
        held, or another host's lease is live."""
        if self.run.root in RunLock._held or self._host_lock_is_held():
            return True
        record = read_record(self.lease_path)
        return bool(record and record.get("host") != self.host and not is_expired(record, self.lease_s))

    def _host_lock_is_held(self) -> bool:
        try:
            fd = os.open(self.host_lock_path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return True
        finally:
            os.close(fd)
        return False

    def acquire(self) -> "RunLock":
        hold = RunLock._held.get(self.run.root)
        if hold is not None:
            hold.depth += 1
            self.held = True
            return self
        self.outermost = True
        self.run.root.mkdir(parents=True, exist_ok=True)
        require_writable(self.run.root, "take the run's lock")
        fd = self._lock_host()
        try:
            lease = self._take_lease()
        except BaseException:
            self._unlock_host(fd)
            raise
        RunLock._held[self.run.root] = _Hold(fd, 1, lease)
        self.held = True
        lease.start_heartbeat(on_lost=lambda: self.run.append_event(
            "lease_lost", holder=self.host, pid=os.getpid(), taken_by=self.holder()))
        return self

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        hold = RunLock._held.get(self.run.root)
        if hold is None:
            return
        hold.depth -= 1
        if hold.depth > 0:
            return
        del RunLock._held[self.run.root]
        try:
            hold.lease.remove()  # while this host's kernel lock still orders the processes here
        finally:
            self._unlock_host(hold.fd)

    # this host's kernel lock -------------------------------------------------------------------
    def _lock_host(self) -> int:
        while True:
            fd = os.open(self.host_lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise RunLockedError(self._locked_here_message()) from None
                raise
            if self._same_file(fd):
                return fd
            os.close(fd)  # the file we locked was unlinked by a releasing holder: lock the new one

    def _unlock_host(self, fd: int) -> None:
        """Remove the host lock file while still holding it, then drop the lock. A process that
        opened the file before the removal and locks it afterwards sees that the path no longer
        names the file it locked (``_same_file``) and tries again, so two holders can never lock
        two different files of the same name."""
        try:
            if self._same_file(fd):
                os.unlink(self.host_lock_path)
        finally:
            os.close(fd)  # closing drops the kernel lock

    def _same_file(self, fd: int) -> bool:
        try:
            return os.stat(self.host_lock_path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    # the lease ---------------------------------------------------------------------------------
    def _take_lease(self) -> Lease:
        lease = Lease(self.lease_path, self.host, self.lease_s)
        for _ in range(5):  # each turn loses only to another process that changed the lease meanwhile
            if lease.create():
                return lease
            seen = read_record(self.lease_path)
            if seen is None:
                continue  # released between our create and our read
            if seen.get("host") == self.host:
                kind = "stale_lock_cleared"  # its writer on this host is gone: we hold this host's lock
            elif is_expired(seen, self.lease_s):
                kind = "stale_lease_taken_over"
            else:
                raise RunLockedError(self._lease_message(seen))
            if lease.clear_stale(seen):  # then create ours on the next turn (or judge a faster one's)
                self.run.append_event(kind, previous_holder=public(seen),
                                      renewed_ago_s=round(renewed_ago(seen), 3), host=self.host)
        raise RunLockedError(f"run directory {self.run.root}: its lease kept changing while this process "
                             f"tried to take it; held by {self._who(self.holder())}. Try again.")

    # messages ----------------------------------------------------------------------------------
    @staticmethod
    def _who(info: Optional[dict]) -> str:
        if not info or info.get("pid") is None:
            return "another process"
        since = f" since {time.ctime(info['since'])}" if info.get("since") else ""
        return f"pid {info.get('pid')} on {info.get('host')}{since}"

    def _lease_message(self, seen: dict) -> str:
        ago = renewed_ago(seen)
        expiry = float(seen.get("expires_after_s") or self.lease_s)
        if seen.get("unreadable"):
            return (f"run directory {self.run.root}: its lease {self.lease_path} is unreadable (damaged, or another "
                    f"machine's lease still being written) and was written {ago:.1f} s ago; it is taken over once "
                    f"{expiry:g} s old: try again in {max(expiry - ago, 0.0):.0f} s")
        return (f"run directory {self.run.root} is locked by {self._who(seen)}: its lease was renewed "
                f"{ago:.1f} s ago and lapses after {expiry:g} s without renewal. Wait for that run to "
                f"finish, or stop it on {seen.get('host')}; if that machine is gone, the next start "
                f"{max(expiry - ago, 0.0):.0f} s from now takes the run over (check the hosts' clocks "
                f"agree if this persists)")

    def _locked_here_message(self) -> str:
        info = None
        for _ in range(20):  # the holder writes its lease right after locking: give it a moment
            info = self.holder()
            if info and info.get("pid") is not None:
                break
            time.sleep(0.01)
        return (f"run directory {self.run.root} is locked by {self._who(info)}; wait for it to finish "
                f"(the lock is released the moment that process exits, however it exits)")

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    @staticmethod
    def _forget_inherited() -> None:
        """In a forked child: close the inherited lock files (the parent keeps its locks; a flock
        is dropped only when every copy of the open file is closed) and hold nothing."""
        for hold in RunLock._held.values():
            try:
                os.close(hold.fd)
            except OSError:
                pass
        RunLock._held.clear()


os.register_at_fork(after_in_child=RunLock._forget_inherited)
