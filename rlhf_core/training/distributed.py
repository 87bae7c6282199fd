"""Process-group set-up for DeepSpeed: one process, or one rank of a torchrun / deepspeed launch.

DeepSpeed needs a process group even for one process. Without MASTER_ADDR/PORT, RANK, WORLD_SIZE and
LOCAL_RANK it tries MPI discovery (and fails without mpi4py), so a single process gets them set here
with a free loopback port. gloo on CPU (oneCCL is absent), nccl on CUDA. DeepSpeed's shared-memory
all-reduce op would be JIT-compiled on first init (~70 s); it is switched off, which falls back to
plain gloo — the same results, a little slower for large all-reduces on one host.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: str
    """'cpu' or 'cuda:<local_rank>'."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _single_process_env() -> None:
    """Fill in the rank variables a launcher would set, for a world of one."""
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")


def _local_rank_from_argv() -> None:
    # The deepspeed launcher passes --local_rank=N instead of setting LOCAL_RANK.
    import sys

    for arg in sys.argv:
        if arg.startswith("--local_rank="):
            os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[1])


def init_distributed(device: str = "cpu") -> DistInfo:
    """Initialise (once per process) the default process group and return this rank's place in it.

    ``device`` is 'cpu' or 'cuda' (see ``ds_config.resolve_device``). Safe to call again: an
    existing process group is reused.
    """
    import torch
    import torch.distributed as tdist

    _local_rank_from_argv()
    _single_process_env()
    if device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    backend = "nccl" if device == "cuda" else "gloo"
    if not tdist.is_initialized():
        if os.environ["WORLD_SIZE"] == "1":
            # a world of one needs no rendezvous: an in-process store, so no port is picked and then
            # taken by another process before it is bound (two runs, or two test workers, on one machine)
            tdist.init_process_group(backend=backend, store=tdist.HashStore(), rank=0, world_size=1)
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)  # DeepSpeed's comm on that group
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    where = "cpu"
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        where = f"cuda:{local_rank}"
    return DistInfo(rank=tdist.get_rank(), world_size=tdist.get_world_size(), local_rank=local_rank, device=where)


def shutdown_distributed() -> None:
    """Tear the default process group down before the process exits.

    Left to interpreter exit, gloo's worker threads are joined from a C++ destructor racing the
    interpreter's own teardown; now and then that ends the rank in SIGABRT ("terminate called
    without an active exception") after its work succeeded, and the launcher reports a failure.
    """
    import torch.distributed as tdist

    if tdist.is_initialized():
        tdist.destroy_process_group()


def all_reduce(tensor, op: str = "sum"):
    """In-place all-reduce over the default group (a no-op for one process); returns ``tensor``."""
    import torch.distributed as tdist

    if tdist.is_initialized() and tdist.get_world_size() > 1:
        tdist.all_reduce(tensor, op={"sum": tdist.ReduceOp.SUM, "max": tdist.ReduceOp.MAX}[op])
    return tensor


def barrier() -> None:
    import torch.distributed as tdist

    if tdist.is_initialized() and tdist.get_world_size() > 1:
        tdist.barrier()

