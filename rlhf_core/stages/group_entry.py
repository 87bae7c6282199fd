"""Entry point of each rank of a run's worker group (``training.worker_group``), started by
``training.group_trainer.GroupTrainer`` when the update spans several processes — once per flow run, or
with ``--one-update`` for one update outside a flow (`rlhf stage update`, ``run_trainer.one_update_trainer``:
its trainers are not kept, the update writes its checkpoint at once, then the group closes):

    torchrun --standalone --nproc_per_node N -m rlhf_core.stages.group_entry \
        --store 127.0.0.1:PORT --run-dir RUN --device cpu|cuda [--one-update]

Every rank keeps a ``ResidentTrainer`` (its engines, its rollback snapshot, its optimizer shard)
and runs the coordinator's commands in step with the others:

    update    iteration K's PPO update (rank 0 writes metrics.json and state.json)
    settle    commit (a save when due: every rank writes its shard) or rollback (snapshot put back)
    writes    wait for this rank's background save, raising its failure (before every commit)
    hold      hold iteration K's state, rebuilt by replay when only its record is left, and saved
    share     this rank's share of a stage's model passes (the stage's ``share`` function), borrowing the
              module the rank trains; with vLLM, generating on this rank's rank of the run's
              engines (kept for the flow run, synced in place by the trainer after each update)
    publish   rank 0 writes the held weights as model directories (for the flow process's own loads)
    close     the last-good state made durable when asked, then leave
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import yaml

from rlhf_core.config import RLHFConfig, config_from_dict
from rlhf_core.io.allocator import keep_freed_memory
from rlhf_core.errors import RLHFError, disk_full_as_user_error
from rlhf_core.run.layout import RunDir
from rlhf_core.stages.catalog import stage_functions
from rlhf_core.run.session import RunSession
from rlhf_core.training.checkpoint import full_state_dict, save_tokenizer
from rlhf_core.training.distributed import DistInfo, init_distributed, shutdown_distributed
from rlhf_core.training.resident import ResidentTrainer
from rlhf_core.training.worker_group import serve


def _config(command: dict) -> RLHFConfig:
    return config_from_dict(yaml.safe_load(command["config"]))


class Rank:
    """One rank's command handlers (see the module docstring)."""

    def __init__(self, run: RunDir, dist: DistInfo, *, kept: bool = True):
        self.run, self.dist = run, dist
        self.session = RunSession()
        """This rank's session for the group's life: the module its trainer lends, its rank of the
        vLLM engines, the frozen models its shares of score and guard load."""
        self.trainer = ResidentTrainer(run, self.session.live if kept else None)
        self.session.trainer = self.trainer

    def handlers(self) -> dict:
        ops = {"update": self.update, "settle": self.settle, "hold": self.hold, "share": self.share,
               "publish": self.publish, "writes": self.writes, "close": self.close}
        return {name: self._disk_full_in_one_line(op) for name, op in ops.items()}

    def _disk_full_in_one_line(self, op):
        """A full disk outside the atomic writers (a rank writes its own checkpoint shard in place)
        becomes the one-line user error the coordinator raises, not a rank's traceback."""
        def run(command: dict):
            with disk_full_as_user_error(self.run.root):
                return op(command)

        return run

    def update(self, command: dict) -> dict[str, Any]:
        metrics = self.trainer.update(_config(command), command["iteration"],
                                      progress=command.get("progress") if self.dist.is_main else False)
        return {"holds": self.trainer.holds, "metrics": metrics if self.dist.is_main else None}

    def settle(self, command: dict) -> dict[str, Any]:
        self.trainer.settle(command["iteration"], command["outcome"], save=command["save"])
        return {"holds": self.trainer.holds}

    def hold(self, command: dict) -> dict[str, Any]:
        self.trainer.hold_recorded(command["iteration"])
        self.trainer.save_held(wait=True)  # rebuilt once: a later crash starts from here
        return {"holds": self.trainer.holds}

    def writes(self, command: dict) -> None:
        self.trainer.check_writes()
        return None

    def share(self, command: dict) -> None:
        rank, world = self.dist.rank, command["world"]
        if rank >= world:
            return None
        stage, k = command["stage"], command["iteration"]
        # vLLM: this rank keeps its rank of the run's engines for the whole flow run (built by the first
        # generation; the trainer syncs it after each update)
        self.session.live.keep_engines(_config(command).actor_rollout_ref.rollout.name == "vllm")
        before = torch.get_num_threads()
        torch.set_num_threads(command["threads"])
        try:
            stage_functions(stage).share(_config(command), self.run, k, rank, world,
                                         self.run.stage_rank_share(k, stage, rank), self.session)
        finally:
            torch.set_num_threads(before)
        return None

    def publish(self, command: dict) -> None:
        """The held weights as Hugging Face model directories under ``out`` (rank 0 writes; every
        rank joins the gather a partitioned module would need)."""
        out = Path(command["out"])
        for role, te in zip(("actor", "critic"), (self.trainer.actor, self.trainer.critic)):
            if te is None:
                continue
            weights = full_state_dict(te, self.dist)
            if weights is not None:
                te.module.save_pretrained(out / role, state_dict=weights, safe_serialization=True)
                save_tokenizer(self.trainer.tokenizer, out / role)
        return None

    def close(self, command: dict) -> None:
        try:
            self.trainer.close(make_durable=command["durable"])
        finally:
            self.session.live.keep_engines(False)  # this rank's rank of the vLLM engines, if it kept one
        return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="rlhf_core.stages.group_entry")
    parser.add_argument("--store", required=True, help="the coordinator's TCPStore, HOST:PORT")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), required=True)
    parser.add_argument("--one-update", action="store_true",
                        help="a group for one update (`rlhf stage update`): its checkpoint written at once, nothing kept")
    args = parser.parse_args(argv)
    keep_freed_memory()  # this rank's update and passes reuse freed pages (rlhf_core.io.allocator)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))  # "cuda" below = this rank's GPU
    dist = init_distributed(args.device)
    rank = Rank(RunDir(args.run_dir), dist, kept=not args.one_update)
    try:
        serve(args.store, dist.rank, rank.handlers(), last="close", user_errors=(RLHFError,))
    finally:
        shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
