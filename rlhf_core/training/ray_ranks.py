"""A worker group's ranks placed on a Ray cluster's nodes: what `trainer.nnodes > 1` runs on.

The cluster is the one verl users already start (`ray start --head` on the node that runs the
flow, `ray start --address=HEAD:6379` on each other one). The flow on the head reserves the ranks'
resources in one placement group — ``trainer.nnodes`` bundles, one per node (STRICT_SPREAD), each
holding that node's ``nproc_per_node`` ranks (a GPU each on CUDA, a CPU each otherwise) — then
starts one Ray actor per rank in its node's bundle. Each actor runs the rank as torchrun would: a
child process of the group entry with the rendezvous in its environment (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR = rank 0's node as Ray reports it, MASTER_PORT = a port free there), so
the rank code is the same on one machine and on a cluster: ``torch.distributed`` (gloo on CPU,
NCCL on GPU), DeepSpeed, the worker group's command loop (``training.worker_group``).

    head: the flow (Prefect)                       each node's actors (ranks r of that node)
    placement group: nnodes bundles ──────────►     actor r: python -m <entry> ... (child process)
    WorkerGroup's command store ◄── commands ──►    the ranks' `serve` loop
    poll(): each actor's rank still running?        its output lines, polled into the group's log

Failures are Ray's to detect and one line each here: no cluster at the address; a cluster without
the nodes or devices the placement group needs (within ``trainer.ray_placement_timeout_s``, naming
what it has and what is missing); a node lost while its ranks run (the actor dies with its raylet:
the group fails naming the node). The run directory must be on storage every node sees at the same
path (the ranks of each node write their checkpoint shards there), as must the model and data paths.

Nothing else in the code imports Ray: it is an optional extra (``pip install '.[ray]'``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlhf_core.config.verl_keys import RAY_STEPS
from rlhf_core.errors import RLHFError

if TYPE_CHECKING:
    from rlhf_core.training.worker_group import RayPlacement

POLL_S = 0.2
"""How often the coordinator fetches the ranks' output and exit statuses."""
LOST_NODE = -9
"""The exit status a rank of a lost node is given (its process died with the node)."""


PROBE_TIMEOUT_S = 3.0
"""How long the cluster's address may take to accept a connection before it is taken for none:
ray.init itself retries a dead address for minutes, logging each try."""


def _unreachable(address: str) -> Optional[str]:
    """Why ``address`` (HOST:PORT, or ray://HOST:PORT) has no cluster listening, else None ("auto"
    is Ray's own lookup of the cluster this node belongs to, which fails at once)."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return None
    try:
        socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT_S).close()
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def connect(address: str) -> None:
    """Join the cluster at ``address`` as a driver (once per process); one line when there is none."""
    if ray.is_initialized():
        return
    why = _unreachable(address)
    if why:
        raise RLHFError(f"trainer.nnodes > 1 runs the update's ranks on a Ray cluster, and nothing answers at "
                        f"{address!r} ({why}); {RAY_STEPS}; trainer.ray_address (or $RAY_ADDRESS) names the head")
    try:
        ray.init(address=address, log_to_driver=False, logging_level="ERROR", configure_logging=True,
                 include_dashboard=False)
    except ConnectionError as exc:
        raise RLHFError(f"trainer.nnodes > 1 runs the update's ranks on a Ray cluster, and there is none at "
                        f"{address!r} ({str(exc).splitlines()[0]}); {RAY_STEPS}") from None


def driver_address(address: str) -> str:
    """This node's address as the cluster's other nodes reach it (after joining the cluster)."""
    connect(address)
    return ray.util.get_node_ip_address()


def bundle(placement: RayPlacement) -> dict[str, float]:
    """One node's share of the placement group: its ranks' devices (a CPU each to run them)."""
    per_node = float(placement.nproc_per_node)
    return {"CPU": per_node, "GPU": per_node} if placement.device == "cuda" else {"CPU": per_node}


def cluster_lines() -> list[str]:
    """The cluster as the flow finds it: one line per alive node (its address and resources)."""
    lines = []
    for node in sorted((n for n in ray.nodes() if n.get("Alive")), key=lambda n: n["NodeManagerAddress"]):
        res = node.get("Resources", {})
        devices = ", ".join(f"{res[k]:g} {k}" for k in ("CPU", "GPU") if res.get(k))
        lines.append(f"ray node {node['NodeManagerAddress']} ({node['NodeID'][:8]}): {devices or 'no CPU or GPU'}")
    return lines


def _shortfall(placement: RayPlacement) -> str:
    """What the cluster lacks for ``placement``: nodes, or devices on them."""
    need = bundle(placement)
    alive = [n for n in ray.nodes() if n.get("Alive")]
    fitting = [n for n in alive if all(n.get("Resources", {}).get(k, 0) >= v for k, v in need.items())]
    wanted = ", ".join(f"{v:g} {k}" for k, v in need.items())
    return (f"it needs {placement.nnodes} nodes with {wanted} free each (trainer.nnodes={placement.nnodes}, "
            f"{placement.nproc_per_node} process(es) per node) and has {len(alive)} node(s), {len(fitting)} of them "
            f"that large")


def _die_with_parent() -> None:
    """In the rank's process before it runs: SIGKILL when the actor that started it dies (a lost
    node's raylet takes its workers with it; the rank must not outlive them, waiting in a collective)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


PR_SET_PDEATHSIG = 1
"""Linux prctl option: the signal a process gets when its parent dies."""


@ray.remote(num_cpus=0)
class RankProcess:
    """One rank on its node: the group entry as a child process, its output kept for the coordinator."""

    def __init__(self) -> None:
        self._proc: Optional[subprocess.Popen] = None
        self._lines: list[str] = []
        self._lock = threading.Lock()

    def where(self) -> tuple[str, str, int]:
        """(this node's address as Ray reports it, its node id, a TCP port free on it)."""
        address = ray.util.get_node_ip_address()  # where the other nodes reach this one: the rendezvous listens there
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((address, 0))
            port = s.getsockname()[1]
        return address, ray.get_runtime_context().get_node_id(), port

    def start(self, argv: Sequence[str], env: dict[str, str], cwd: str) -> int:
        """Start the rank: ``python argv...`` with this node's interpreter, in ``cwd``; its pid."""
        gpus = ray.get_gpu_ids()
        if gpus:  # Ray gave this actor its GPU: the rank sees it alone, as its device 0 (LOCAL_RANK picks the device)
            env = {**env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus)), "LOCAL_RANK": "0"}
        here = cwd if os.path.isdir(cwd) else None  # the head's directory, where the nodes share it
        self._proc = subprocess.Popen([sys.executable, *argv], env={**os.environ, **env}, cwd=here,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True, preexec_fn=_die_with_parent)
        threading.Thread(target=self._pump, daemon=True).start()
        return self._proc.pid

    def _pump(self) -> None:
        for line in self._proc.stdout:
            with self._lock:
                self._lines.append(line)

    def poll(self) -> tuple[Optional[int], list[str]]:
        """(the rank's exit status or None while it runs, the output lines since the last poll)."""
        with self._lock:
            lines, self._lines = self._lines, []
        return self._proc.poll(), lines

    def stop(self) -> None:
        """Kill the rank and whatever it started."""
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()


class RayRanks:
    """The coordinator's side: ``world`` ranks of ``argv`` placed by Ray, their output fed to
    ``feed`` line by line; ``poll`` / ``stop`` as for torchrun's process."""

    def __init__(self, placement: RayPlacement, argv: Sequence[str], env: dict[str, str],
                 feed: Callable[[str], None], say: Callable[[str], None]):
        connect(placement.address)
        for line in cluster_lines():
            say(line)
        self.placement = placement
        self._feed = feed
        self._actors: list = []
        self.nodes: list[tuple[str, str, int]] = []
        self.returncode: Optional[int] = None
        self.lost: Optional[str] = None
        """The node whose ranks were lost with it (its address), once one was."""
        self._pg = placement_group([bundle(placement)] * placement.nnodes, strategy="STRICT_SPREAD")
        try:
            ray.get(self._pg.ready(), timeout=placement.timeout_s)
        except GetTimeoutError:
            remove_placement_group(self._pg)
            raise RLHFError(f"the Ray cluster cannot place the update's {placement.world} ranks within "
                            f"{placement.timeout_s:g} s (trainer.ray_placement_timeout_s): {_shortfall(placement)}; "
                            f"add nodes (`ray start --address=HEAD_IP:6379` on each) or lower trainer.nnodes") from None
        try:
            self._actors = [self._actor(rank // placement.nproc_per_node) for rank in range(placement.world)]
            self.nodes = ray.get([a.where.remote() for a in self._actors])
            master_addr, _, master_port = self.nodes[0]
            cwd = os.getcwd()
            ray.get([actor.start.remote(argv, {**env, **self._rank_env(rank, master_addr, master_port)}, cwd)
                     for rank, actor in enumerate(self._actors)])
        except BaseException:
            self.stop(0)
            raise

    def _actor(self, node: int):
        gpus = 1 if self.placement.device == "cuda" else 0
        strategy = PlacementGroupSchedulingStrategy(placement_group=self._pg, placement_group_bundle_index=node)
        return RankProcess.options(num_cpus=1, num_gpus=gpus, scheduling_strategy=strategy).remote()

    def _rank_env(self, rank: int, master_addr: str, master_port: int) -> dict[str, str]:
        per_node = self.placement.nproc_per_node
        return {"RANK": str(rank), "LOCAL_RANK": str(rank % per_node), "WORLD_SIZE": str(self.placement.world),
                "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(rank // per_node),
                "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}

    def poll(self) -> Optional[int]:
        """None while every rank runs; else the first exit status seen (``LOST_NODE`` for a rank
        whose node is gone, ``lost`` naming it). The ranks' output so far is fed first."""
        if self.returncode is None:
            codes = [self._poll(rank) for rank in range(len(self._actors))]
            failed = [code for code in codes if code not in (None, 0)]
            if failed:
                self.returncode = failed[0]
            elif all(code == 0 for code in codes):
                self.returncode = 0
        return self.returncode

    def _poll(self, rank: int) -> Optional[int]:
        """Rank ``rank``'s exit status (None while it runs), its new output fed."""
        try:
            code, lines = ray.get(self._actors[rank].poll.remote(), timeout=30)
        except (RayActorError, GetTimeoutError):
            self.lost = self.lost or self.nodes[rank][0]
            return LOST_NODE
        for line in lines:
            self._feed(line)
        return code

    def stop(self, grace_s: float) -> None:
        """Kill every rank that still runs (after ``grace_s`` for them to leave by themselves), then
        the actors and the placement group: nothing is left on the cluster."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(self._poll(r) is None for r in range(len(self._actors))):
            time.sleep(POLL_S)
        for rank, actor in enumerate(self._actors):
            with contextlib.suppress(Exception):
                ray.get(actor.stop.remote(), timeout=10)
            self._poll(rank)  # the last lines
            with contextlib.suppress(Exception):
                ray.kill(actor)
        with contextlib.suppress(Exception):
            remove_placement_group(self._pg)
