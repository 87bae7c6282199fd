"""How a worker group's or a stage's ranks are run and heard: their output line by line into a log
(``LaunchOutput``: the whole of it kept, the last lines and the ranks' own one-line errors held
for the failure's line), the environment that shares a node's cores among them (``rank_env``),
and a launcher's failure in one line (``failure_line``). Where the ranks start: torchrun on this
machine (``training.worker_group``, ``stages.ranks``), a Ray cluster's nodes (``training.ray_ranks``).
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from rlhf_core.progress import quiet_console

GROUP_ENTRY = "rlhf_core.stages.group_entry"
"""The module every rank of a worker group runs (``training.worker_group``): the run's ranks kept
for a whole flow run instead of one launch per update."""
USER_ERROR = "rlhf: error: "
"""How a rank's user error begins: its message already names the key and the fix."""


@dataclass(frozen=True)
class LaunchResult:
    returncode: int
    tail: list[str]
    """The last lines of the launch's output."""
    user_errors: list[str]
    log: Optional[Path] = None
    """The whole output (``LaunchOutput``)."""

    def failure(self, what: str) -> str:
        """The launch's failure in one line: what failed, why, where the whole output is."""
        return failure_line(what, self.returncode, self.tail, self.log)


class LaunchOutput:
    """torchrun's output as it comes: every line into ``log`` (the whole of it, named by the error
    after a failure), the last lines and the ranks' user errors kept, and each line passed through
    to stderr, except on `rlhf run`'s quiet console, which gets only the ranks' own `rlhf:` lines
    (torchrun's failure dump, tracebacks and library chatter stay in the log)."""

    def __init__(self, log: Optional[Path] = None):
        self.tail: collections.deque[str] = collections.deque(maxlen=25)
        self.user_errors: list[str] = []
        self.log = log
        self._quiet = quiet_console()
        self._file = None
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(log, "a", encoding="utf-8", errors="replace")
            self._file.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} ---\n")

    def feed(self, line: str) -> None:
        if self._file is not None:
            self._file.write(line)
            self._file.flush()
        if not self._quiet or line.startswith("rlhf:"):
            sys.stderr.write(line)
        self.tail.append(line.rstrip())
        if USER_ERROR in line:
            self.user_errors.append(line.split(USER_ERROR, 1)[1].strip())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def result(self, returncode: int) -> LaunchResult:
        return LaunchResult(returncode, list(self.tail), list(self.user_errors), self.log)


_EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception|Interrupt)\b.*: \S")


def root_cause(lines: list[str]) -> Optional[str]:
    """What torchrun's failure dump names as the root cause ('rank 1 exited with -9 (SIGKILL):
    Signal 9 (SIGKILL) received by PID 11393'), else the last exception line of a rank's
    traceback, else None."""
    start = next((i for i in range(len(lines) - 1, -1, -1) if lines[i].startswith("Root Cause")), None)
    if start is not None:
        fields = {}
        for line in lines[start + 1:]:
            key, sep, value = line.strip().partition(":")
            if sep and key.strip() in ("rank", "exitcode", "traceback") and key.strip() not in fields:
                fields[key.strip()] = " ".join(value.split())
        if "rank" in fields:
            why = fields.get("traceback", "")
            why = "" if why.startswith(("<N/A>", "To enable traceback")) else f": {why}"
            return f"rank {fields['rank']} exited with {fields.get('exitcode', '?')}{why}"
    for line in reversed(lines):
        if _EXCEPTION_LINE.match(line.strip()) and "ChildFailedError" not in line:
            return line.strip()
    return None


def failure_line(what: str, returncode: int, tail: list[str], log: Optional[Path]) -> str:
    """'<what> failed (exit N): <root cause>; torchrun's whole output: <log>' (without a log, the
    last lines follow instead)."""
    cause = root_cause(tail)
    line = f"{what} failed (exit {returncode})" + (f": {cause}" if cause else "")
    if log is not None:
        return f"{line}; torchrun's whole output: {log}"
    return f"{line}; last output:\n" + "\n".join(tail)


def rank_env(nproc_per_node: int) -> dict[str, str]:
    """This process's environment for a launch, with the node's cores shared by its ranks."""
    return dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // nproc_per_node)))


def stream(cmd: list[str], env: dict[str, str], watch: Optional[Callable[[subprocess.Popen], None]] = None,
           log: Optional[Path] = None) -> LaunchResult:
    """Run ``cmd``, its output through ``LaunchOutput`` (into ``log``); ``watch(proc)`` runs beside it
    in a thread."""
    output = LaunchOutput(log)
    try:
        with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
            if watch is not None:
                threading.Thread(target=watch, args=(proc,), daemon=True).start()
            try:
                for line in proc.stdout:
                    output.feed(line)
            except KeyboardInterrupt:
                stop(proc)
                raise
    finally:
        output.close()
    return output.result(proc.returncode)


def stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop a torchrun agent: SIGINT (it passes it to its ranks), then SIGKILL after ``grace_s``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
