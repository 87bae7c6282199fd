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

Across machines (``RayPlacement``: trainer.nnodes > 1) Ray places the ranks on a cluster's nodes
(``training.ray_ranks``: one actor per rank, each running the same rank process torchrun would) and
the store listens on this node's address as the others reach it; a lost node ends the group as a
rank's failure does.

Failure: a rank's error ends the group (the other ranks may be waiting in a collective that will
never complete): torchrun is stopped and the error raised here, as ``RLHFError`` when the rank's
was a user error (its one line). The ranks leave by themselves when the coordinator dies (its
store's connection closes). They ignore Ctrl-C: a terminal sends it to the whole process group, and
the coordinator, which gets it too, decides (it asks them to leave, then kills what is left).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from rlhf_core.errors import RLHFError
from rlhf_core.notes import say_once
from rlhf_core.training.launch import LaunchOutput, failure_line, rank_env

READY = "ready/{rank}"
COMMAND = "cmd/{seq}"
REPLY = "done/{seq}/{rank}"
LEAVE = "leave"
"""The command that ends the group without a reply (an idle rank exits at once)."""
STOP_GRACE_S = 3.0
"""After asking the ranks to leave, how long before the group is killed: a rank still busy then is
blocked in a collective or a store call (in C++, where no signal reaches Python) and never will."""
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


class _Torchrun:
    """The ranks on this machine: torchrun's process, its output read by a thread of its own."""

    def __init__(self, cmd: list[str], env: dict[str, str], output: LaunchOutput):
        self._proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._output = output
        self._thread = threading.Thread(target=self._pump, name="worker-group-output", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        for line in self._proc.stdout:
            self._output.feed(line)

    def poll(self) -> Optional[int]:
        return self._proc.poll()

    def stop(self, grace_s: float) -> None:
        """Until torchrun has ended (killed with its ranks after ``grace_s``) and its output is read."""
        _stop_tree(self._proc, grace_s)
        self._thread.join(5.0)


@dataclass(frozen=True)
class RayPlacement:
    """Where a group's ranks go when they span machines (trainer.nnodes > 1): a Ray cluster's nodes
    (``training.ray_ranks``, the only module that loads Ray, an optional extra)."""

    nnodes: int
    nproc_per_node: int
    device: str
    """cpu or cuda: a CPU or a GPU per rank."""
    address: str
    """The cluster (ray.init's address): "auto" = the one this node belongs to."""
    timeout_s: float
    """How long the placement may wait for the cluster's nodes before the start is refused."""

    @property
    def world(self) -> int:
        return self.nnodes * self.nproc_per_node


class WorkerGroup:
    """The coordinator's side: start ``world`` ranks of ``entry`` under torchrun, send them
    commands, stop them. One command at a time (the flow's stages run one after the other)."""

    def __init__(self, entry: str, world: int, args: Sequence[str] = (), *, what: str = "worker group",
                 placement: Optional[RayPlacement] = None, log: Optional[Path] = None):
        """``entry``: the module every rank runs (or a script's path, ending in .py), given
        ``--store HOST:PORT`` and ``args``; it calls ``serve``. With ``placement`` the ranks span a
        Ray cluster's nodes. ``log``: where the ranks' whole output goes (a failure is one line
        naming it)."""
        import torch.distributed as tdist

        self.world, self.what, self.placement = world, what, placement
        ray_ranks = importlib.import_module("rlhf_core.training.ray_ranks") if placement else None
        host = ray_ranks.driver_address(placement.address) if ray_ranks else "127.0.0.1"
        self._store = tdist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        store = f"{host}:{self._store.port}"
        self._output = LaunchOutput(log)
        # a rank whose coordinator died would print the store's C++ warning with a stack trace: the
        # coordinator's own error (or the kill) already says what happened
        quiet = {"TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR")}
        self.alive = False
        if ray_ranks is None:
            self._ranks = _Torchrun(_one_node_command(entry, world, store, args), {**rank_env(world), **quiet},
                                    self._output)
        else:
            threads = {"OMP_NUM_THREADS": rank_env(placement.nproc_per_node)["OMP_NUM_THREADS"]}
            self._ranks = ray_ranks.RayRanks(placement, [*_target(entry), "--store", store, *args],
                                             {**quiet, **threads}, self._output.feed, say_once)
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
        replies: dict[int, dict] = {}
        try:
            while len(replies) < self.world:
                self._wait_for([REPLY.format(seq=seq, rank=r) for r in range(self.world) if r not in replies], None,
                               op, any_of=True)
                for r in range(self.world):
                    key = REPLY.format(seq=seq, rank=r)
                    if r not in replies and self._store.check([key]):
                        replies[r] = json.loads(self._store.get(key))
                failed = [reply for reply in replies.values() if not reply["ok"]]
                if failed:  # the others may wait for the failed rank in a collective: do not wait for them
                    first = min(failed, key=lambda reply: (not reply["user_error"], reply["rank"]))
                    raise RankFailure(first["rank"], first["error"], first["user_error"])
        except BaseException:
            self.kill()  # a failure, Ctrl-C, or a rank gone
            raise
        return [replies[r]["result"] for r in range(self.world)]

    def close(self, op: Optional[str] = None, timeout_s: float = 120.0, **payload: Any) -> None:
        """Send the last command ``op`` (the ranks leave after it) and wait for torchrun to end;
        without ``op`` the ranks are told to leave at once (``kill``)."""
        try:
            if op is not None and self.alive:
                self.call(op, **payload)
                self._wait_exit(timeout_s)
        finally:
            self.kill()

    def kill(self) -> None:
        """End the group: idle ranks are told to leave; whatever still runs after ``STOP_GRACE_S``
        (a rank waiting in a collective for one that failed) is killed, torchrun and every rank."""
        self.alive = False
        with contextlib.suppress(Exception):
            self._store.set(COMMAND.format(seq=self._seq), json.dumps({"op": LEAVE}))
        self._ranks.stop(STOP_GRACE_S)
        self._output.close()

    def _wait_exit(self, timeout_s: float) -> None:
        """Until the ranks have left by themselves (after the last command), at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self._ranks.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)

    def _failure(self, how: str) -> RLHFError:
        """The error of a group whose ranks are gone: a rank's own one-line error first, then a lost
        Ray node, else the output's tail."""
        code = self._ranks.poll()
        result = self._output.result(code if code is not None else -1)
        if self._output.user_errors:
            return RLHFError(self._output.user_errors[0])
        lost = getattr(self._ranks, "lost", None)
        if lost:
            return RLHFError(f"the {self.what} lost Ray node {lost} ({how}): its ranks died with it (a stopped "
                             f"raylet, a machine that went down) and the other ranks were stopped; once the cluster "
                             f"has its nodes again (`ray status`), `rlhf run --resume RUN` continues from the last "
                             f"committed iteration")
        return RLHFError(result.failure(f"the {self.what} ({how})"))

    def _wait_for(self, keys: list[str], timeout_s: Optional[float], what: str, any_of: bool = False) -> None:
        """Until every key is set (``any_of``: one of them); fails when torchrun ends first (or
        after ``timeout_s``)."""
        started, delay = time.monotonic(), 0.0005
        while not (any(self._store.check([k]) for k in keys) if any_of else self._store.check(keys)):
            if self._ranks.poll() is not None:
                self._ranks.stop(STOP_GRACE_S)  # the output to its end: a rank's last line may be its error
                raise self._failure(f"ended during {what!r}")
            if timeout_s is not None and time.monotonic() - started > timeout_s:
                raise RLHFError(failure_line(f"the {self.what}'s {self.world} processes did not {what} within "
                                             f"{timeout_s:.0f} s, they", -1, list(self._output.tail), self._output.log))
            time.sleep(delay)
            delay = min(delay * 2, 0.02)  # sub-millisecond replies stay fast, long ones cost no CPU


def _target(entry: str) -> list[str]:
    """How the interpreter runs ``entry``: a script's path, or a module."""
    return [entry] if entry.endswith(".py") else ["-m", entry]


def _one_node_command(entry: str, world: int, store: str, args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", f"--nproc_per_node={world}",
            *_target(entry), "--store", store, *args]


def _stop_tree(proc: subprocess.Popen, grace_s: float) -> None:
    """Wait up to ``grace_s`` for torchrun to end by itself, then SIGKILL its ranks and it. (SIGINT
    would not do: torchrun passes it on and waits for ranks a signal cannot reach; killing only
    torchrun would leave them running, holding its output pipe.)"""
    import psutil

    try:
        proc.wait(timeout=grace_s)
        return
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
    proc.kill()
    proc.wait()


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

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the coordinator's to act on (see the module doc)
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
        if command["op"] == LEAVE:
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
