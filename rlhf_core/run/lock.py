"""The run directory's writer lock: at most one process writes a run, and a dead holder never
blocks it.

The lock is a kernel lock (``flock``) on ``run.lock``, not the file's existence: the kernel drops
it the instant its holder dies, however it dies (kill -9 included), so a lock is stale exactly when
its holder is gone and nobody has to guess from a pid. The file carries the holder's pid, host and
start time, written after the lock is taken, for the error a competitor prints; a file still
naming a holder when the next one locks it was left by a process that died holding it (the
``stale_lock_cleared`` event). A holder removes the file on release while it still holds the lock;
a process that opened the file before that removal and locks it afterwards sees that the path no
longer names the file it locked (another inode, or none) and tries again, so two holders can
never lock two different files of the same name.

Re-entrant within one process (the flow holds it and calls stages that take it again). A forked
child is another process: it inherits the holder's open lock file, and with it the kernel lock,
so the child closes its copies at once (``_forget_inherited``); otherwise a helper the holder
forked would keep the run locked after the holder died, and would count as the holder itself.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from typing import Optional

from rlhf_core.errors import RLHFError
from rlhf_core.run.layout import RunDir


class RunLockedError(RLHFError, RuntimeError):
    """Another live process holds the run directory."""


class RunLock:
    """Exclusive, re-entrant writer lock on a run directory (see the module docstring)."""

    _held: dict = {}  # run root → [open fd, depth]: one kernel lock per process and run

    def __init__(self, run: RunDir):
        self.run = run
        self.held = False
        self.outermost = False
        """Whether this acquire took the kernel lock (not a re-entry of this process's own hold):
        only the outermost holder speaks for the run (e.g. marks earlier flow runs crashed)."""

    def holder(self) -> Optional[dict]:
        """Who wrote the lock file last (the holder while it is locked); None when unreadable."""
        try:
            info = json.loads(self.run.lock_path.read_text())
        except (OSError, ValueError):
            return None
        return info if isinstance(info, dict) else None

    def is_locked(self) -> bool:
        """Whether some process holds the lock now (ours included)."""
        if self.run.root in RunLock._held:
            return True
        try:
            fd = os.open(self.run.lock_path, os.O_RDONLY)
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
        held = RunLock._held.get(self.run.root)
        if held is not None:
            held[1] += 1
            self.held = True
            return self
        self.outermost = True
        self.run.root.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.run.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise RunLockedError(self._locked_message()) from None
                raise
            if self._same_file(fd):
                break
            os.close(fd)  # the file we locked was unlinked by a releasing holder: lock the new one
        previous = self.holder()
        self._write_holder(fd)
        RunLock._held[self.run.root] = [fd, 1]
        self.held = True
        if previous:  # a clean release removes the file: this one's holder died holding it
            self.run.append_event("stale_lock_cleared", previous_holder=previous)
        return self

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        held = RunLock._held.get(self.run.root)
        if held is None:
            return
        held[1] -= 1
        if held[1] > 0:
            return
        del RunLock._held[self.run.root]
        fd = held[0]
        try:
            if self._same_file(fd):  # removed while still locked: see the module docstring
                os.unlink(self.run.lock_path)
        finally:
            os.close(fd)  # closing drops the kernel lock

    def _same_file(self, fd: int) -> bool:
        try:
            return os.stat(self.run.lock_path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    @staticmethod
    def _write_holder(fd: int) -> None:
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        os.fsync(fd)

    def _locked_message(self) -> str:
        info = None
        for _ in range(20):  # the holder writes its line right after locking: give it a moment
            info = self.holder()
            if info and "since" in info:
                break
            time.sleep(0.01)
        who = (f"pid {info.get('pid')} on {info.get('host')} since {time.ctime(info['since'])}"
               if info and "since" in info else "another process")
        return (f"run directory {self.run.root} is locked by {who}; wait for it to finish (the lock is "
                f"released the moment that process exits, however it exits)")

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    @staticmethod
    def _forget_inherited() -> None:
        """In a forked child: close the inherited lock files (the parent keeps its locks; a flock
        is dropped only when every copy of the open file is closed) and hold nothing."""
        for fd, _depth in RunLock._held.values():
            try:
                os.close(fd)
            except OSError:
                pass
        RunLock._held.clear()


os.register_at_fork(after_in_child=RunLock._forget_inherited)
