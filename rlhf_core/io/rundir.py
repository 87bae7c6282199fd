"""The run directory: one place for every path a stage reads or writes.

    runs/<name>/
      config.yaml                 resolved config of the run (what `rlhf config show` prints)
      run.lock                    held by the process writing the run (pid, host, start time)
      manifest.json               setup stages (preprocess, pack): status, hashes, rows, timings
      prompts/train.parquet       preprocessed prompts (verl columns + tokenized prompt)
      prompts/val.parquet         held-out validation prompts
      prompts/rejects.parquet     rows that were not accepted, each with its reason
      pack/generation_batches.parquet   token-budget generation batches over the train prompts
      pack/summary.json           packing statistics
      kl_ctrl.json                KL controller state (survives resume)
      last_good.json              pointer to the last committed iteration's checkpoint
      events.jsonl                rollbacks, skips, alerts
      iter_<k>/manifest.json      per-iteration stages (rollout, score, gae, update, guard)
      iter_<k>/rollout.parquet    responses
      iter_<k>/scored.parquet     rewards, old/ref log-probs, values
      iter_<k>/advantages.parquet token rewards (KL penalty), advantages, returns
      iter_<k>/checkpoint/        actor (HF safetensors), critic, DeepSpeed state, manifest
      iter_<k>/metrics.json       the iteration's metrics
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pyarrow.parquet as pq

from rlhf_core.errors import RLHFError
from rlhf_core.io.atomic import atomic_write_json

SETUP_STAGES = ("preprocess", "pack")
ITERATION_STAGES = ("rollout", "score", "gae", "update", "guard")


class RunLockedError(RLHFError, RuntimeError):
    """Another live process holds the run directory."""


@dataclass(frozen=True)
class RunDir:
    root: Path

    def __init__(self, root: str | Path):
        object.__setattr__(self, "root", Path(root).resolve())

    # setup ---------------------------------------------------------------------------------
    @property
    def config_path(self) -> Path:
        return self.root / "config.yaml"

    @property
    def lock_path(self) -> Path:
        return self.root / "run.lock"

    @property
    def prompts_dir(self) -> Path:
        return self.root / "prompts"

    @property
    def train_prompts(self) -> Path:
        return self.prompts_dir / "train.parquet"

    def train_prompt_count(self) -> int:
        """Rows of prompts/train.parquet, from its footer (nothing but the metadata is read)."""
        return pq.ParquetFile(self.train_prompts).metadata.num_rows

    @property
    def val_prompts(self) -> Path:
        return self.prompts_dir / "val.parquet"

    @property
    def rejects(self) -> Path:
        return self.prompts_dir / "rejects.parquet"

    @property
    def pack_dir(self) -> Path:
        return self.root / "pack"

    @property
    def generation_batches(self) -> Path:
        return self.pack_dir / "generation_batches.parquet"

    @property
    def kl_ctrl_path(self) -> Path:
        return self.root / "kl_ctrl.json"

    @property
    def last_good_path(self) -> Path:
        return self.root / "last_good.json"

    @property
    def events_path(self) -> Path:
        return self.root / "events.jsonl"

    @property
    def models_dir(self) -> Path:
        """Initial models the run starts from (e.g. the built tiny model)."""
        return self.root / "models"

    # per iteration ----------------------------------------------------------------------------
    def iter_dir(self, k: int) -> Path:
        return self.root / f"iter_{k}"

    def rollout(self, k: int) -> Path:
        return self.iter_dir(k) / "rollout.parquet"

    def scored(self, k: int) -> Path:
        return self.iter_dir(k) / "scored.parquet"

    def advantages(self, k: int) -> Path:
        return self.iter_dir(k) / "advantages.parquet"

    def checkpoint(self, k: int) -> Path:
        return self.iter_dir(k) / "checkpoint"

    def metrics(self, k: int) -> Path:
        return self.iter_dir(k) / "metrics.json"

    def manifest_path(self, k: Optional[int]) -> Path:
        return self.root / "manifest.json" if k is None else self.iter_dir(k) / "manifest.json"

    def iterations(self) -> list[int]:
        """Iteration numbers present on disk, ascending."""
        found = []
        for p in self.root.glob("iter_*"):
            suffix = p.name[len("iter_"):]
            if p.is_dir() and suffix.isdigit():
                found.append(int(suffix))
        return sorted(found)

    # small state ------------------------------------------------------------------------------
    def read_json(self, path: Path, default: Any = None) -> Any:
        if not path.is_file():
            return default
        return json.loads(path.read_text())

    def append_event(self, kind: str, iteration: Optional[int] = None, **fields: Any) -> dict:
        """Append one event line (rollback, alert, skipped step). Appends of one short line are
        atomic enough on POSIX; readers skip a torn last line."""
        event = {"time": time.time(), "kind": kind, "iteration": iteration, **fields}
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.events_path, "a") as fh:
            fh.write(json.dumps(event, default=str) + "\n")
        return event

    def events(self) -> list[dict]:
        out = []
        if self.events_path.is_file():
            for line in self.events_path.read_text().splitlines():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        return out


# ---------------------------------------------------------------------------------------------
# lock
# ---------------------------------------------------------------------------------------------


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """Exclusive writer lock on a run directory (``O_EXCL`` file with the holder's pid and host).

    A second writer fails at once naming the holder. A lock left by a dead process on this host is
    stale: ``acquire(break_stale=True)`` (the default) clears it and says so in the event log.
    """

    _depth: dict[Path, int] = {}  # re-entrancy within one process: flow → stage calls

    def __init__(self, run: RunDir):
        self.run = run
        self.held = False

    def holder(self) -> Optional[dict]:
        try:
            return json.loads(self.run.lock_path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def is_stale(self, info: Optional[dict]) -> bool:
        if info is None:
            return True
        return info.get("host") == socket.gethostname() and not _pid_alive(int(info.get("pid", -1)))

    def acquire(self, break_stale: bool = True) -> "RunLock":
        self.run.root.mkdir(parents=True, exist_ok=True)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        for _ in range(2):
            try:
                fd = os.open(self.run.lock_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                info = self.holder()
                if info and info.get("pid") == os.getpid() and info.get("host") == me["host"]:
                    RunLock._depth[self.run.root] = RunLock._depth.get(self.run.root, 0) + 1
                    self.held = True
                    return self
                if break_stale and self.is_stale(info):
                    self.run.lock_path.unlink(missing_ok=True)
                    self.run.append_event("stale_lock_cleared", previous_holder=info)
                    continue
                raise RunLockedError(
                    f"run directory {self.run.root} is locked by pid {info.get('pid') if info else '?'} "
                    f"on {info.get('host') if info else '?'} since "
                    f"{time.ctime(info['since']) if info and 'since' in info else '?'}; wait for it to "
                    f"finish, or if that process is gone, delete {self.run.lock_path}"
                ) from None
            with os.fdopen(fd, "w") as fh:
                json.dump(me, fh)
            RunLock._depth[self.run.root] = 1
            self.held = True
            return self
        raise RunLockedError(f"could not acquire {self.run.lock_path}")

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        depth = RunLock._depth.get(self.run.root, 1) - 1
        RunLock._depth[self.run.root] = depth
        info = self.holder()
        if depth <= 0 and info and info.get("pid") == os.getpid():
            self.run.lock_path.unlink(missing_ok=True)

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def write_config(run: RunDir, cfg_yaml: str) -> None:
    from rlhf_core.io.atomic import atomic_write_text

    atomic_write_text(run.config_path, cfg_yaml)


__all__ = [
    "ITERATION_STAGES", "RunDir", "RunLock", "RunLockedError", "SETUP_STAGES", "atomic_write_json",
    "write_config",
]
