"""The engines of a run kept by a worker group of the update's processes, when its update spans
several (``trainer.nproc``, GPUs, nodes): the flow process's handle on the group's ranks
(``training.worker_group``), each of which holds a ``training.resident.ResidentTrainer`` of its own
(``stages.group_entry``) and runs the stages' model passes dealt to it (``stages.ranks``)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import torch

from rlhf_core.config import RLHFConfig, resolve, to_yaml
from rlhf_core.config.reads import build
from rlhf_core.config.machine import cuda_devices
from rlhf_core.config.schema import TrainerConfig
from rlhf_core.errors import RLHFError
from rlhf_core.io import timing
from rlhf_core.run.layout import RunDir
from rlhf_core.training.ds_config import resolve_device
from rlhf_core.training.launch import GROUP_ENTRY
from rlhf_core.training.settings import update_world
from rlhf_core.training.worker_group import RankFailure, RayPlacement, WorkerGroup

PROCESS_LAUNCH = "process_launch"
"""io.timing kind: starting a worker group's processes (interpreters, imports, the process group)."""


class GroupTrainer:
    """The engines of one run kept by a worker group of the update's processes
    (``training.worker_group``), for a flow run whose update spans several processes of this
    machine. Each rank holds a ``ResidentTrainer`` of its own and serves its module to the stages'
    model passes it runs: score, guard, rollout and validation are dealt to the group's ranks
    (``stages.ranks``), each rank borrowing the weights it trained. This object is the flow
    process's handle on them and holds no model; anything the flow process must load itself is
    published for it on first ask (a ``models.live.Provider``)."""

    def __init__(self, cfg: RLHFConfig, run: RunDir, *, one_update: int = 0):
        """``one_update``: K for a group started for iteration K's update alone (its ranks' trainers
        are not kept: ``ResidentTrainer.kept``); 0 for the group keeping a flow run's models."""
        self.run = run
        self.world = build(update_world, cfg)
        device = resolve_device(cfg.trainer.device)
        args = ["--run-dir", str(run.root), "--device", device, *(["--one-update"] if one_update else [])]
        what = (f"update of iteration {one_update} on {self.world} processes" if one_update
                else f"worker group of {self.world} update processes")
        started = time.perf_counter()
        self.group = WorkerGroup(GROUP_ENTRY, self.world, args, what=what,
                                 placement=_placement(cfg.trainer, device),
                                 log=run.launch_log(f"update-iter_{one_update}" if one_update else "worker-group"))
        timing.add(PROCESS_LAUNCH, time.perf_counter() - started)
        self.holds: Optional[int] = None
        """The iteration whose state the ranks hold (None: none built yet; 0: the initial models)."""
        self._published: Optional[tuple[int, Path]] = None
        self._copies = 0

    def update(self, cfg: RLHFConfig, k: int, *, progress: Optional[bool] = None) -> dict[str, Any]:
        """Iteration ``k``'s PPO update on every rank (``ResidentTrainer.update``; ``progress``: rank
        0's bars); rank 0's metrics."""
        self._unpublish()
        result = self._call("update", cfg, iteration=k, progress=progress)[0]
        self.holds = result["holds"]
        timing.add(timing.UPDATE_SETUP, float(result["metrics"].get("perf/setup_seconds", 0.0)))
        timing.add(timing.CHECKPOINT_WRITE, float(result["metrics"].get("perf/checkpoint_seconds", 0.0)))
        return result["metrics"]

    def settle(self, k: int, outcome: str, *, save: bool) -> None:
        """``ResidentTrainer.settle`` on every rank (a rollback puts each rank's snapshot back)."""
        holds = self._call("settle", None, iteration=k, outcome=outcome, save=save)[0]["holds"]
        if holds != self.holds:
            self._unpublish()
        self.holds = holds

    def check_writes(self) -> None:
        """``ResidentTrainer.check_writes`` on every rank (each writes its own shard in the background)."""
        self._call("writes", None)

    def ensure(self, k: int) -> bool:
        """Make the ranks hold iteration ``k``'s state; when they did not, it is rebuilt there by
        replay (as its record describes it) and written as a checkpoint. Returns whether it was."""
        if self.holds == k:
            return False
        self._unpublish()
        self.holds = self._call("hold", None, iteration=k)[0]["holds"]
        return True

    def run_shares(self, cfg: RLHFConfig, k: int, stage: str, world: int) -> None:
        """Ranks 0..world-1 each write their share of ``stage``'s model passes (``stages.ranks``), at
        this process's intra-op thread count: CPU reductions then split as in one process."""
        self._call("share", cfg, stage=stage, iteration=k, world=world, threads=torch.get_num_threads())

    def close(self, *, make_durable: bool = True) -> None:
        """The ranks write the last-good state when it is only in memory (``make_durable``), then
        leave; without it (Ctrl-C) they are just stopped: a resume replays what was only in memory."""
        try:
            if self.group.alive and make_durable:
                self._call("close", None, durable=True)
        finally:
            self.group.close()
            self._unpublish()

    # -- models.live.Provider ------------------------------------------------------------------

    def provides(self, directory: Path) -> bool:
        if not self.holds:
            return False
        ckpt = self.run.checkpoint(self.holds).resolve()
        return directory in (ckpt / "actor", ckpt / "critic") and not directory.is_dir()

    def publish(self, directory: Path) -> Path:
        if self._published is None or self._published[0] != self.holds:
            self._unpublish()
            self._copies += 1  # a new name each time: the scoring cache keys loaded models by path
            out = self.run.published_weights(self.holds, self._copies)
            with timing.timed(timing.CHECKPOINT_WRITE):
                self._call("publish", None, iteration=self.holds, out=str(out))
            self._published = (self.holds, out)
        return self._published[1] / directory.name

    def _unpublish(self) -> None:
        if self._published is not None:
            shutil.rmtree(self._published[1], ignore_errors=True)
            self._published = None

    def _call(self, op: str, cfg: Optional[RLHFConfig], **payload: Any) -> list[Any]:
        try:
            return self.group.call(op, config=to_yaml(cfg) if cfg is not None else None, **payload)
        except RankFailure as exc:
            if exc.user_error:
                raise RLHFError(exc.message) from None
            raise RuntimeError(f"rank {exc.rank} of the {self.group.what} failed in {op!r}:\n{exc.message}") from None


def _placement(trainer: TrainerConfig, device: str) -> Optional[RayPlacement]:
    """Where the group's ranks go when the update spans machines: a Ray cluster (None: this one alone)."""
    nnodes, per_node = resolve.update_nodes(trainer, cuda_devices() if trainer.device != "cpu" else 0)
    if nnodes == 1:
        return None
    return RayPlacement(nnodes, per_node, device, resolve.ray_address(trainer, os.environ),
                        float(trainer.ray_placement_timeout_s))


def rebuild_in_group(cfg: RLHFConfig, run: RunDir, k: int) -> bool:
    """``training.run_trainer.ensure_state`` for a run whose update spans several processes: the replay must run on as
    many ranks (their reductions split the batch as the update did), so a group is started for it."""
    trainer = GroupTrainer(cfg, run)
    try:
        return trainer.ensure(k)
    finally:
        trainer.close(make_durable=False)
