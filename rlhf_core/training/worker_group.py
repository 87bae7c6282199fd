"""A worker group: the update's ranks started once and kept for a whole flow run.

Without it, an update on several processes starts ``torchrun`` every iteration: interpreters,
imports, the process group, model loads and ``deepspeed.initialize`` on every rank, and a full
(sharded) checkpoint written so the next iteration's ranks can start from it. With it the ranks
stay up between iterations, each holding its engines (``training.resident``), and the flow
process sends them one command at a time:

    flow process (coordinator)                      torchrun ranks 0..N-1 (one per device)
    a TCPStore on 127.0.0.1:PORT  ── cmd/<n> ──►    every rank runs command n (the same on every
                                                    rank: they meet in its collectives)
    waits for every rank's reply  ◄── done/<n>/<r>  {"ok": true, "result": ...} or the error
    (and for torchrun to still be running)

A command is a JSON object ``{"op": name, ...}``; the ranks' handlers are given by the entry
module that runs them (``stages.group_entry``), so this module knows nothing of what they do.
The store is torch's own key-value server (what torchrun's rendezvous uses), so no other
transport is needed; a command's round trip costs under a millisecond.

Failure: a rank's error ends the group (the other ranks may be waiting in a collective that will
never complete): torchrun is stopped and the error raised here, as ``RLHFError`` when the rank's
was a user error (its one line). The ranks leave by themselves when the coordinator dies (its
store's connection closes); Ctrl-C reaches them through torchrun as for any launch.
"""

from __future__ import annotations

import collections
import datetime
import json
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from rlhf_core.errors import RLHFError
from rlhf_core.training.nodes import USER_ERROR, rank_env, stop

READY = "ready/{rank}"
COMMAND = "cmd/{seq}"
REPLY = "done/{seq}/{rank}"
START_TIMEOUT_S = 600.0
"""How long the ranks may take to start (interpreters, imports, the process group) before the
group is given up; a loaded CPU machine needs ~10-30 s."""


@dataclass
class RankFailure(Exception):
    """A rank's command raised: its message (one line for a user error, else the traceback)."""

    rank: int
    message: str
    user_error: bool

    def __str__(self) -> str:
        return self.message


class _Output:
    """Passes torchrun's output through to stderr in a thread, keeping its tail and user errors."""

    def __init__(self, proc: subprocess.Popen):
        self.tail: collections.deque[str] = collections.deque(maxlen=25)
        self.user_errors: list[str] = []
        self._thread = threading.Thread(target=self._pump, args=(proc,), name="worker-group-output", daemon=True)
        self._thread.start()

    def _pump(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            sys.stderr.write(line)
            self.tail.append(line.rstrip())
            if USER_ERROR in line:
                self.user_errors.append(line.split(USER_ERROR, 1)[1].strip())

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


class WorkerGroup:
    """The coordinator's side: start ``world`` ranks of ``entry_module`` under torchrun, send them
    commands, stop them. One command at a time (the flow's stages run one after the other)."""

    def __init__(self, entry_module: str, world: int, args: Sequence[str] = (), *, what: str = "worker group"):
        import torch.distributed as tdist

        self.world, self.what = world, what
        self._store = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
               f"--nproc_per_node={world}", "-m", entry_module, "--store", f"127.0.0.1:{self._store.port}", *args]
        self._proc = subprocess.Popen(cmd, env=rank_env(world), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True)
        self._output = _Output(self._proc)
        self._seq = 0
        self.alive = True
        try:
            self._wait_for([READY.format(rank=r) for r in range(world)], START_TIMEOUT_S, "start")
        except BaseException:
            self.kill()
            raise

    def call(self, op: str, **payload: Any) -> list[Any]:
        """Run command ``op`` on every rank; returns each rank's result, rank order."""
        if not self.alive:
            raise RLHFError(f"the {self.what} has stopped after an earlier failure; resume the run to start a new one")
        seq, self._seq = self._seq, self._seq + 1
        self._store.set(COMMAND.format(seq=seq), json.dumps({"op": op, **payload}))
        keys = [REPLY.format(seq=seq, rank=r) for r in range(self.world)]
        try:
            self._wait_for(keys, None, op)
        except BaseException:
            self.kill()  # Ctrl-C, or a rank gone: the rest may wait in a collective forever
            raise
        replies = [json.loads(self._store.get(k)) for k in keys]
        failed = [r for r in replies if not r["ok"]]
        if failed:
            self.kill()
            first = min(failed, key=lambda r: (not r["user_error"], r["rank"]))
            raise RankFailure(first["rank"], first["error"], first["user_error"])
        return [r["result"] for r in replies]

    def close(self, op: Optional[str] = None, timeout_s: float = 120.0, **payload: Any) -> None:
        """Send the last command ``op`` (the ranks leave after it), then wait for torchrun to end."""
        try:
            if op is not None and self.alive:
                self.call(op, **payload)
            if self._proc.poll() is None:
                self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:
            self.kill()

    def kill(self) -> None:
        """Stop torchrun and its ranks (SIGINT, then SIGKILL): the group is gone."""
        self.alive = False
        stop(self._proc)
        self._output.join(5.0)

    def _wait_for(self, keys: list[str], timeout_s: Optional[float], what: str) -> None:
        """Until every key is set; fails when torchrun ends first (or after ``timeout_s``)."""
        started, delay = time.monotonic(), 0.0005
        while not self._store.check(keys):
            if self._proc.poll() is not None:
                self._output.join(5.0)
                if self._output.user_errors:
                    raise RLHFError(self._output.user_errors[0])
                raise RLHFError(f"the {self.what} ended during {what!r} (exit {self._proc.returncode}); last output:\n"
                                + "\n".join(self._output.tail))
            if timeout_s is not None and time.monotonic() - started > timeout_s:
                raise RLHFError(f"the {self.what}'s {self.world} processes did not {what} within {timeout_s:.0f} s; "
                                "last output:\n" + "\n".join(self._output.tail))
            time.sleep(delay)
            delay = min(delay * 2, 0.02)  # sub-millisecond replies stay fast, long ones cost no CPU


# ---------------------------------------------------------------------------------------------
# the ranks' side
# ---------------------------------------------------------------------------------------------

Handler = Callable[[dict], Any]
"""A command handler: the command's JSON object in, a JSON-able result out."""


def serve(address: str, rank: int, handlers: dict[str, Handler], *, last: str, user_errors: tuple[type, ...]) -> None:
    """Run commands from the coordinator at ``address`` until ``last`` has run (or the coordinator
    is gone). A handler's exception is replied, not raised: a user error (``user_errors``) as its
    one line, anything else with its traceback; the rank then leaves (the coordinator stops the
    others, which may be waiting for it in a collective)."""
    import torch.distributed as tdist

    host, port = address.rsplit(":", 1)
    store = tdist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=60))
    store.set(READY.format(rank=rank), "1")
    forever = datetime.timedelta(days=365)
    for seq in range(sys.maxsize):
        key = COMMAND.format(seq=seq)
        try:
            store.wait([key], forever)  # raises at once when the coordinator's store goes away
            command = json.loads(store.get(key))
        except tdist.DistError:
            return
        try:
            reply = {"ok": True, "rank": rank, "result": handlers[command["op"]](command)}
        except user_errors as exc:
            reply = {"ok": False, "rank": rank, "error": str(exc), "user_error": True}
        except Exception:  # noqa: BLE001 - handed to the coordinator, which raises it there
            reply = {"ok": False, "rank": rank, "error": traceback.format_exc(), "user_error": False}
        store.set(REPLY.format(seq=seq, rank=rank), json.dumps(reply))
        if command["op"] == last or not reply["ok"]:
            return
