"""Where a worker group's ranks start (``training.worker_group``): on this machine alone, or on
several through torchrun's own rendezvous.

One machine (trainer.nnodes=1): ``torchrun --standalone --nproc_per_node N``.

Several machines (trainer.nnodes > 1), with torchrun's static rendezvous (node ranks given, so the
global rank order — and with it the result — is the same on every run):

    node 0: the flow / `rlhf stage update`          node r (1 .. nnodes-1): `rlhf node join --run-dir RUN
                                                    --node-rank r`, started once and left running
    writes RUN/nodes/update_request.json   ──────►  sees a request it has not run, writes its record
                                                    RUN/nodes/<launch id>.node<r>.json ("joined"),
    torchrun --node_rank 0 ...                      torchrun --node_rank r ... (the same arguments),
    (waits up to trainer.node_join_timeout_s         its record rewritten with a heartbeat meanwhile;
     for every node, then fails naming the           records its exit status, waits for the next one;
     ones without a record and what to run there;    leaves when the run is finished or on Ctrl-C
     stops when a node fails or its heartbeat stops)
    removes the request when the group ends

A request is a whole worker group: the ranks keeping a flow run's models, or the ranks of one
update started by `rlhf stage update` (``training.resident.update_once``). Its commands pass
through node 0's TCPStore; the run directory carries the request, the checkpoint shards each node's
ranks write and rank 0's metrics, so it must be on storage every node sees at the same path (a
shared filesystem). Model and data paths in the config must resolve on every node too. Node 0's
address and port come from ``config.resolve.update_rendezvous``.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

from rlhf_core.config import resolve
from rlhf_core.config.schema import TrainerConfig
from rlhf_core.errors import RLHFError
from rlhf_core.io.atomic import atomic_write_json
from rlhf_core.progress import quiet_console
from rlhf_core.run.layout import RunDir, StateFileError
from rlhf_core.run.lifecycle import last_good_iteration
from rlhf_core.run.saved_config import run_config_tree

GROUP_ENTRY = "rlhf_core.stages.group_entry"
"""The module every rank of a worker group runs (``training.worker_group``): the run's ranks kept
for a whole flow run instead of one launch per update."""
USER_ERROR = "rlhf: error: "
"""How a rank's user error begins: its message already names the key and the fix."""
FAILED_NODE_GRACE_S = 10.0
"""After another node records a failed exit, how long node 0's torchrun may still end by itself
before it is stopped (its ranks would otherwise wait on the dead ranks' collectives)."""
POLL_S = 0.5
"""How often a joiner looks for a new request, and node 0 for failed nodes."""
HEARTBEAT_S = 2.0
"""How often a joiner rewrites its record while its torchrun runs."""
DEAD_AFTER_S = 30.0
"""A joined node whose record has not changed for this long is taken for dead (15 missed beats:
a loaded shared filesystem may delay a few)."""


@dataclass(frozen=True)
class UpdateRequest:
    """One multi-node launch of a worker group (``GROUP_ENTRY``), as every node runs it."""

    launch_id: str
    """Unique per launch: a joiner runs each launch id once."""
    nnodes: int
    nproc_per_node: int
    master_addr: str
    master_port: int
    join_timeout_s: int
    created_at: float
    """Node 0's clock (time.time()) when the request was written."""
    store: str
    """The coordinator's TCPStore, HOST:PORT: the group's commands."""
    device: str = "cpu"
    """The group's device type (cpu or cuda)."""
    iteration: int = 0
    """0: the group keeping a flow run's models; K: a group started for iteration K's update alone
    (``training.resident.update_once``)."""

    @property
    def what(self) -> str:
        """What node 0's errors call this launch."""
        first = f"update of iteration {self.iteration}" if self.iteration else "the run's worker group"
        return f"{first} on {self.nnodes} nodes (launch {self.launch_id})"

    @property
    def label(self) -> str:
        """What a joiner's lines call this launch."""
        return f"launch {self.launch_id} ({f'iteration {self.iteration}' if self.iteration else 'the worker group'})"


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


def node_command(request: UpdateRequest, run: RunDir, node_rank: int) -> list[str]:
    """torchrun for node ``node_rank`` of ``request`` (static rendezvous at node 0's address; its
    timeout bounds both node 0's wait for the others and theirs for node 0)."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={request.nnodes}",
            f"--nproc_per_node={request.nproc_per_node}", f"--node_rank={node_rank}",
            f"--master_addr={request.master_addr}", f"--master_port={request.master_port}",
            "--rdzv_backend=static", f"--rdzv_conf=timeout={request.join_timeout_s}", "--max_restarts=0",
            *_target(request, run)]


def _target(request: UpdateRequest, run: RunDir) -> list[str]:
    return ["-m", GROUP_ENTRY, "--store", request.store, "--run-dir", str(run.root), "--device", request.device,
            *(["--one-update"] if request.iteration else [])]


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


# node 0 of several ----------------------------------------------------------------------------
def node0_address(trainer: TrainerConfig) -> tuple[str, int]:
    """(host, port) where the nodes of a multi-node launch meet (``config.resolve.update_rendezvous``)."""
    addr, port = resolve.update_rendezvous(trainer, os.environ)
    if addr is None:  # fit_to_machine refuses this at load; a config built around it lands here
        raise RLHFError(f"trainer.nnodes={trainer.nnodes}: set trainer.master_addr=HOST (node 0's address)")
    return addr, port


def group_request(nnodes: int, nproc_per_node: int, master_addr: str, master_port: int, join_timeout_s: int,
                  store: str, device: str, iteration: int = 0) -> UpdateRequest:
    """A launch of a worker group on every node: its ranks stay up until the group is closed."""
    return UpdateRequest(launch_id=uuid.uuid4().hex[:12], nnodes=nnodes, nproc_per_node=nproc_per_node,
                         master_addr=master_addr, master_port=master_port, join_timeout_s=join_timeout_s,
                         created_at=time.time(), store=store, device=device, iteration=iteration)


def publish_request(run: RunDir, request: UpdateRequest) -> None:
    """Make ``request`` what every other node's joiner runs next (``withdraw_request`` ends that)."""
    atomic_write_json(run.update_request, asdict(request))


def withdraw_request(run: RunDir) -> None:
    run.update_request.unlink(missing_ok=True)


def node_records(run: RunDir, request: UpdateRequest) -> dict[int, dict]:
    """Node rank → its joiner's record of ``request`` (nodes without a record are absent)."""
    records = {}
    for r in range(1, request.nnodes):
        try:
            record = run.read_json(run.node_record(request.launch_id, r))
        except StateFileError:  # torn by a dying writer: it joined, nothing more is known
            record = {"status": "joined"}
        if isinstance(record, dict):
            records[r] = record
    return records


def failed_nodes(records: dict[int, dict]) -> dict[int, object]:
    """Node rank → exit status, for the nodes whose torchrun ended badly."""
    return {r: rec.get("exit") for r, rec in records.items() if rec.get("status") == "exited" and rec.get("exit") != 0}


class NodeWatch:
    """Beside node 0's torchrun: stops it soon after another node's torchrun failed, or once a
    joined node's heartbeat has not changed for ``dead_after_s`` (its machine or joiner died: the
    ranks here would wait on its ranks up to the process group's own timeout, 30 minutes). A
    heartbeat is compared with its previous value on this node's clock, so clocks need not agree."""

    def __init__(self, run: RunDir, request: UpdateRequest, dead_after_s: float):
        self.run, self.request, self.dead_after_s = run, request, dead_after_s
        self.failed: dict[int, object] = {}
        """Node rank → exit status of the nodes whose torchrun failed."""
        self.silent: list[int] = []
        """Nodes that stopped beating."""
        self._beats: dict[int, tuple[object, float]] = {}  # node → (last beat seen, when it changed)

    def check(self) -> bool:
        """Look at the nodes' records once; True when node 0 should stop."""
        records, now = node_records(self.run, self.request), time.monotonic()
        self.failed = failed_nodes(records)
        for r, record in records.items():
            if record.get("status") == "exited":
                continue
            beat = record.get("beat")
            if r not in self._beats or self._beats[r][0] != beat:
                self._beats[r] = (beat, now)
            elif now - self._beats[r][1] > self.dead_after_s and r not in self.silent:
                self.silent.append(r)
        return bool(self.failed or self.silent)

    def __call__(self, proc: subprocess.Popen) -> None:
        while proc.poll() is None:
            if self.check():
                deadline = time.monotonic() + FAILED_NODE_GRACE_S
                while proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(POLL_S)
                stop(proc)
                return
            time.sleep(POLL_S)


def join_command(run: RunDir, node_rank: int) -> str:
    return f"rlhf node join --run-dir {run.root} --node-rank {node_rank}"


def launch_failure(run: RunDir, request: UpdateRequest, result: LaunchResult,
                   watch: Optional[NodeWatch] = None) -> RLHFError:
    """The error of a failed multi-node launch: first the nodes that never joined (with what to run
    there), then the nodes that stopped answering or failed, then a rank's own error, else the
    output's tail."""
    records = node_records(run, request)
    missing = [r for r in range(1, request.nnodes) if r not in records]
    where = request.what
    if missing:
        commands = "; ".join(f"node {r}: `{join_command(run, r)}`" for r in missing)
        return RLHFError(f"{where}: node(s) {', '.join(map(str, missing))} did not join within "
                         f"trainer.node_join_timeout_s={request.join_timeout_s}s. Start the joiner there "
                         f"({commands}); {run.root} must be on storage every node sees at that path")
    if watch is not None and watch.silent:
        return RLHFError(f"{where}: node(s) {', '.join(map(str, watch.silent))} stopped answering (no heartbeat in "
                         f"{watch.dead_after_s:.0f}s: the machine or its `rlhf node join` died); node 0 stopped too. "
                         "Restart the joiner there and rerun the stage (or resume the run)")
    failed = failed_nodes(records)
    if failed:
        said = ", ".join(f"node {r} (exit {code})" for r, code in failed.items())
        return RLHFError(f"{where}: {said} failed; its joiner's output says why"
                         + (f" ({result.user_errors[0]})" if result.user_errors else ""))
    if result.user_errors:
        return RLHFError(result.user_errors[0])
    return RLHFError(f"{result.failure(where)} (every node joined: check that node 0's "
                     f"{request.master_addr}:{request.master_port} is reachable from each node)")


# the other nodes ------------------------------------------------------------------------------
def read_request(run: RunDir) -> Optional[UpdateRequest]:
    """The request being launched now (None when there is none, or it is being replaced)."""
    try:
        data = run.read_json(run.update_request)
    except StateFileError:
        return None
    if not isinstance(data, dict):
        return None
    try:
        return UpdateRequest(**data)
    except TypeError as exc:
        raise RLHFError(f"{run.update_request}: not an update request this version reads ({exc}); "
                        "run the same rlhf version on every node") from None


def run_finished(run: RunDir) -> Optional[str]:
    """Why the run needs no more updates (None: it may): its last iteration is committed, or the KL
    guard halted it and no resume came after."""
    if not run.config_path.is_file():
        return None
    try:
        total = (run_config_tree(run)[0].get("trainer") or {}).get("total_iterations")
        committed = last_good_iteration(run)
    except (RLHFError, ValueError):  # being rewritten, or damaged: node 0 repairs or reports it
        return None
    if total is not None and committed >= int(total):
        return f"iteration {total} of {total} is committed"
    ends = [e for e in run.events() if e.get("kind") in ("halt", "resume")]
    if ends and ends[-1]["kind"] == "halt":
        return f"halted at iteration {ends[-1].get('iteration')}: {ends[-1].get('reason', '')}".rstrip(": ")
    return None


def _record(run: RunDir, request: UpdateRequest, node_rank: int, **fields: object) -> None:
    atomic_write_json(run.node_record(request.launch_id, node_rank),
                      {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time(), **fields})


def _beat(run: RunDir, request: UpdateRequest, node_rank: int, done: threading.Event) -> None:
    """Rewrite this node's record with a new beat every HEARTBEAT_S until ``done``."""
    beat = 0
    while not done.wait(HEARTBEAT_S):
        beat += 1
        _record(run, request, node_rank, status="running", beat=beat)


def run_request(run: RunDir, request: UpdateRequest, node_rank: int) -> int:
    """Node ``node_rank``'s part of ``request``: its torchrun agent, recorded and beating; returns
    its exit status."""
    if not 1 <= node_rank < request.nnodes:
        raise RLHFError(f"--node-rank {node_rank}: this run's update has nnodes={request.nnodes}, so the other "
                        f"nodes are 1 .. {request.nnodes - 1} (node 0 is the one running the flow)")
    _record(run, request, node_rank, status="joined", beat=0)
    done = threading.Event()
    beating = threading.Thread(target=_beat, args=(run, request, node_rank, done), daemon=True)
    beating.start()
    try:
        result = stream(node_command(request, run, node_rank), rank_env(request.nproc_per_node))
    except KeyboardInterrupt:
        done.set()
        beating.join()
        _record(run, request, node_rank, status="exited", exit="interrupted")
        raise
    done.set()
    beating.join()  # no beat may land after the exit record
    _record(run, request, node_rank, status="exited", exit=result.returncode)
    return result.returncode


def join(run: RunDir, node_rank: int, say: Callable[[str], None]) -> int:
    """Serve node ``node_rank`` of ``run``'s multi-node updates until the run is finished (0).
    Each request runs once per node, across joiner restarts too (its record says it was taken); one
    older than its join timeout is skipped (node 0 stopped waiting)."""
    if node_rank < 1:
        raise RLHFError(f"--node-rank {node_rank}: node 0 is the machine running the flow; joiners are 1 .. nnodes-1")
    say(f"node {node_rank}: waiting for updates of {run.root} (a directory every node sees at this path)")
    seen: set[str] = set()
    while (reason := run_finished(run)) is None:
        request = read_request(run)
        if request is None or request.launch_id in seen:
            time.sleep(POLL_S)
            continue
        seen.add(request.launch_id)
        if run.node_record(request.launch_id, node_rank).exists():  # an earlier joiner of this node took it
            say(f"node {node_rank}: {request.label} was already joined by this node; waiting for the next one")
            continue
        if time.time() - request.created_at > request.join_timeout_s:
            say(f"node {node_rank}: skipping {request.label}: older than its join timeout, node 0 no longer "
                "waits for it")
            continue
        say(f"node {node_rank}: joining {request.label}, {request.nnodes} nodes × {request.nproc_per_node} processes")
        code = run_request(run, request, node_rank)
        say(f"node {node_rank}: launch {request.launch_id} " + ("done" if code == 0 else f"failed (exit {code})"))
    say(f"node {node_rank}: the run is finished ({reason}); leaving")
    return 0
