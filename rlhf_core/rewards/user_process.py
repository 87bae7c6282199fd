"""A user's reward function (``custom_reward_function.path``) run in a process of its own.

In the run's own process, a function that calls ``os._exit(0)`` ended the run with status 0 and
nothing said, and a call that never returned hung the stage for good. Here the function's module is
imported, and every call made, in one child process per ``UserProcess`` (the program is
``user_process_main.py``; a stage opens one for all its rows, so the module is imported afresh for
each stage, as before). Every way out of the user's code becomes one ``DataError`` naming the
function (its name and file): ``sys.exit`` / ``SystemExit``, a ``KeyboardInterrupt`` it raises,
``os._exit`` or a crash (the process's exit status or signal), any other exception (its traceback on
standard error above the line), and a call or import that takes longer than
``custom_reward_function.call_timeout_s`` (the process is killed). A result crosses back as JSON
text, never a pickle (reading a pickle runs whatever its ``__reduce__`` names, in the run's process):
numbers (floats bit for bit), strings, lists and dicts, numpy and torch scalars and arrays as their
numbers; an object of a class of the user's own code, or anything else JSON cannot hold, is refused.

Nothing the function starts outlives its call: the child kills every process below it when a call
returns, and the run kills them before it kills the child at a timeout (``user_process_main``). The
child leaves when its parent closes the pipe, and also as soon as the parent is gone however it went
(kill -9 included); a terminal's Ctrl-C reaches the parent, which stops the child on its way out.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import weakref
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Optional

from rlhf_core.config import ConfigError
from rlhf_core.errors import DataError
from rlhf_core.paths import resolve_path
from rlhf_core.rewards.user_process_main import kill_descendants

PROGRAM = Path(__file__).with_name("user_process_main.py")
"""The child's program, run by its path (importing it as a module would import the package's torch)."""
TIMEOUT_KEY = "custom_reward_function.call_timeout_s"
GRACE_S = 2.0
"""How long a child that was asked to leave (its pipe closed) may take before it is killed."""
POLL_SLICE_S = 0.5
"""The longest a wait for the reward function's reply goes without returning to Python (``_waited_for_reply``)."""
FIX = "return a score (raise an exception for an error)"


def split_target(path: str, name: str) -> tuple[str, str]:
    """'pkg.mod:fn' → ('pkg.mod', 'fn'); '/a/b.py:fn' → ('/a/b.py', 'fn'); else (path, name)."""
    head, sep, tail = path.rpartition(":")
    if sep and tail.isidentifier() and head and not (len(head) == 1 and head.isalpha()):  # not 'C:'
        return head, tail
    return path, name


class UserProcess:
    """The function ``name`` of ``path`` (custom_reward_function.path: 'pkg.module[:fn]' or a .py
    file[:fn]) in a child process: ``call(**kwargs)`` returns its result; ``close()`` ends the child.
    Raises ``ConfigError`` when the module cannot be found or has no such function."""

    def __init__(self, path: str, name: str, timeout_s: float):
        target, self.name = split_target(path, name)
        self.path, self.timeout_s = path, timeout_s
        self.is_file = target.endswith(".py") or "/" in target or "\\" in target
        if self.is_file:
            file = resolve_path(target)
            if not file.is_file():
                raise ConfigError(f"custom_reward_function.path={path!r}: file {file} not found")
            target = str(file)
        self.target = target
        self.shown = f"{self.name!r} of {target}" if self.is_file else f"{target}:{self.name}"
        self.failure: Optional[str] = None
        self._start()
        self._load()

    # the child ---------------------------------------------------------------------------------
    def _start(self) -> None:
        from_parent, to_child = os.pipe()  # parent → child
        from_child, to_parent = os.pipe()  # child → parent
        self._proc = subprocess.Popen(
            [sys.executable, str(PROGRAM), str(os.getpid()), str(from_parent), str(to_parent)],
            pass_fds=(from_parent, to_parent), stdin=subprocess.DEVNULL)
        os.close(from_parent)
        os.close(to_parent)
        self._send = Connection(to_child, readable=False)
        self._receive = Connection(from_child, writable=False)
        self._finalizer = weakref.finalize(self, _stop, self._proc, self._send, self._receive, 0.0)

    def _load(self) -> None:
        self._send.send({"sys_path": list(sys.path), "target": self.target, "is_file": self.is_file,
                         "name": self.name})
        reply = self._reply("to import its module")
        if reply[0] == "no_module":
            raise self._fail(ConfigError(
                f"custom_reward_function.path={self.path!r}: cannot import module {self.target!r} ({reply[1]}); "
                "give 'pkg.module:function' on the Python path, or a .py file"))
        if reply[0] == "no_function":
            raise self._fail(ConfigError(
                f"custom_reward_function: {self.target!r} has no function {self.name!r}; set "
                f"custom_reward_function.name to one of: {', '.join(reply[1]) or '(none)'}"))
        if reply[0] != "ready":
            raise self._fail(DataError(self._ending(reply, "while its module was imported")))

    def call(self, **kwargs: Any) -> Any:
        """The function's result for ``kwargs``; every other way out is a ``DataError``."""
        if self.failure:
            raise DataError(self.failure)
        try:
            self._send.send(kwargs)
        except OSError:  # the child is gone: its exit status says how
            pass
        reply = self._reply("on one response")
        if reply[0] == "ok":
            return reply[1]
        if reply[0] == "own_class":
            raise self._fail(DataError(
                f"the reward function {self.shown} returned an object of its own class {reply[1]}, which the run "
                "could read only by importing that code; return a number, or a dict of numbers, strings and lists"))
        if reply[0] == "unsendable":
            raise self._fail(DataError(f"the reward function {self.shown} returned a value that cannot be sent "
                                       f"back to the run ({reply[1]}); return a number or a dict with a 'score'"))
        raise self._fail(DataError(self._ending(reply, "")))

    def close(self) -> None:
        """End the child: it leaves when its pipe closes; killed if it has not within ``GRACE_S``."""
        self._finalizer.detach()
        _stop(self._proc, self._send, self._receive, GRACE_S)

    def __enter__(self) -> "UserProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # replies -----------------------------------------------------------------------------------
    def _waited_for_reply(self) -> bool:
        """Whether a reply came within ``timeout_s``. Waited in short slices: a Ctrl-C that the kernel
        hands to another thread of this process (torch's, a progress bar's) does not interrupt the
        main thread's wait, and Python runs its handler only once that wait returns."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return self._receive.poll(0)
            if self._receive.poll(min(left, POLL_SLICE_S)):
                return True

    def _reply(self, doing: str) -> tuple:
        if not self._waited_for_reply():
            _stop(self._proc, self._send, self._receive, 0.0)
            raise self._fail(DataError(
                f"the reward function {self.shown} took longer than {TIMEOUT_KEY}={self.timeout_s:g} s {doing} "
                f"and was stopped; make it return sooner, or raise {TIMEOUT_KEY}"))
        try:
            return json.loads(self._receive.recv_bytes())
        except EOFError:
            return ("died", _exit_status(self._proc))

    def _ending(self, reply: tuple, when: str) -> str:
        """The one line for a way out of the user's code other than a result."""
        kind, *detail = reply
        said = f"the reward function {self.shown}"
        when = f" {when}" if when else ""
        if kind == "exit":
            return f"{said} called sys.exit({detail[0]!r}){when}, which would end the run; {FIX}"
        if kind == "interrupt":
            return f"{said} raised KeyboardInterrupt{when}, which would stop the run as Ctrl-C does; {FIX}"
        if kind == "raised":
            where = f" at {detail[1]}" if detail[1] else ""
            return f"{said} raised {detail[0]}{where}{when} (its traceback is above); fix it, or {FIX}"
        status = detail[0]
        if status >= 0:
            return (f"{said} ended its process with exit status {status}{when} (os._exit, or a library it calls "
                    f"exiting), which would have ended the run; {FIX}")
        name = signal.Signals(-status).name if -status in signal.valid_signals() else f"signal {-status}"
        cause = ("the kernel's out-of-memory killer, or a kill" if -status == signal.SIGKILL
                 else "a crash in native code" if -status in (signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT,
                                                               signal.SIGFPE, signal.SIGILL) else "a signal")
        return f"{said} crashed{when}: its process was killed by {name} ({cause}); fix the function, or {FIX}"

    def _fail(self, error: Exception) -> Exception:
        """Remember ``error`` (a later call says it again) and end the child."""
        self.failure = str(error)
        self.close()
        return error


def _exit_status(proc: subprocess.Popen) -> int:
    """The exit status of a child whose pipe just closed (it is exiting: give it a moment)."""
    try:
        return proc.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:  # it closed its end and lives on: stop it
        kill_descendants(proc.pid)
        proc.kill()
        return proc.wait()


def _stop(proc: subprocess.Popen, send: Connection, receive: Connection, grace_s: float) -> None:
    """Close the pipes (the child leaves at its next read) and kill it if it has not left in ``grace_s``."""
    for conn in (send, receive):
        conn.close()
    if proc.poll() is None:
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:
        kill_descendants(proc.pid)  # while the child, their subreaper, still holds them together
        proc.kill()
        proc.wait()
