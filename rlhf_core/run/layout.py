"""The run directory: the only module that spells a file or folder name of a run.

    runs/<name>/
      format.json                 the run directory's format version (run.migrate upgrades older ones)
      config.yaml                 resolved config of the run (what `rlhf config show` prints)
      run.lock                    the writer's lease (host, pid, start, last renewal): valid across
                                  machines sharing the directory (run.lock)
      run.lock.<host>             that host's kernel lock (instant release when its holder dies)
      run.lock.takeover           held while a stale lease is being taken over
      manifest.json               setup stages (preprocess, pack): status, hashes, rows, timings
      prompts/train.parquet       preprocessed prompts (verl columns + tokenized prompt)
      prompts/val.parquet         held-out validation prompts
      prompts/rejects.parquet     rows that were not accepted, each with its reason
      pack/generation_batches.parquet   token-budget generation batches over the train prompts
      pack/summary.json           packing statistics
      last_good.json              the commit log: every committed iteration, in order; the last one is
                                  last-good (the only record of "committed": run.lifecycle)
      events.jsonl                rollbacks, skips, alerts
      models/critic_init/         the initial critic (stage init_critic)
      iter_<k>/manifest.json      per-iteration stages (rollout, score, gae, update, guard, validate)
      iter_<k>/rollout.parquet    responses (rollout_rejects.parquet: offline rows not accepted;
                                  rollout_baseline.parquet: remax's greedy response per prompt)
      iter_<k>/scored.parquet     rewards, old/ref log-probs, values
      iter_<k>/advantages.parquet token rewards (KL penalty), advantages, returns
      iter_<k>/kl_ctrl.json       the KL controller state gae used and the one it hands on (gae's
                                  output: the next iteration reads it from its committed predecessor)
      iter_<k>/retry.json         a KL-breach retry's decision for iteration k: its attempt, the scale
                                  of the reward's KL coefficient (an input of k's gae), its config changes
      iter_<k>/checkpoint/        actor (HF safetensors), critic, DeepSpeed state, manifest: written every
                                  trainer.save_freq iterations and at the end (each with resident models)
      iter_<k>/state.json         the state the update produced: its lineage id, what it started from,
                                  the config it trained with (how a crash or a rerun rebuilds it)
      iter_<k>/metrics.json       the update's metrics
      iter_<k>/guard.json         the KL guard's verdict
      iter_<k>/validation.parquet validation responses and scores
      iter_<k>/iteration_metrics.json  everything the iteration reports (run.report)
      plots/learning_curve.png    the learning curve
      export/actor/               the exported actor (run.export)

Small JSON state is read through ``read_json``, which turns a damaged file into one
``StateFileError`` line naming the file (the caller decides the fallback).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pyarrow.parquet as pq

from rlhf_core.errors import RLHFError
from rlhf_core.io.atomic import atomic_write_text


class StateFileError(RLHFError):
    """A small state file of a run is unreadable (not JSON, or not the shape it must have)."""


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
    def pack_summary(self) -> Path:
        return self.pack_dir / "summary.json"

    @property
    def format_path(self) -> Path:
        """The run directory's format version (``run.migrate``)."""
        return self.root / "format.json"

    @property
    def format_journal(self) -> Path:
        """The tables an upgrade to format 3 has staged and not yet put in place (``run.migrate``)."""
        return self.root / "format_upgrade.json"

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

    @property
    def critic_init(self) -> Path:
        return self.models_dir / "critic_init"

    @property
    def plots_dir(self) -> Path:
        return self.root / "plots"

    @property
    def learning_curve(self) -> Path:
        return self.plots_dir / "learning_curve.png"

    @property
    def export_dir(self) -> Path:
        return self.root / "export"

    @property
    def exported_actor(self) -> Path:
        return self.export_dir / "actor"

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

    def state_record(self, k: int) -> Path:
        """What iteration k's update produced and how to rebuild it (``training.resident``)."""
        return self.iter_dir(k) / "state.json"

    def checkpoint_iteration(self, path: str | Path) -> Optional[int]:
        """k when ``path`` is iteration k's checkpoint directory or lies inside it, else None."""
        path = Path(path).resolve()
        for part in (path, *path.parents):
            if part.name == "checkpoint" and part.parent.parent == self.root:
                suffix = part.parent.name[len("iter_"):]
                if part.parent.name.startswith("iter_") and suffix.isdigit():
                    return int(suffix)
        return None

    def metrics(self, k: int) -> Path:
        """The update's metrics (written by rank 0)."""
        return self.iter_dir(k) / "metrics.json"

    def rollout_rejects(self, k: int) -> Path:
        return self.iter_dir(k) / "rollout_rejects.parquet"

    def rollout_baseline(self, k: int) -> Path:
        """One greedy response per prompt group of iteration k (schema ROLLOUT; remax's baseline)."""
        return self.iter_dir(k) / "rollout_baseline.parquet"

    def verdict(self, k: int) -> Path:
        return self.iter_dir(k) / "guard.json"

    def kl_state(self, k: int) -> Path:
        """The KL controller state iteration k's gae used and the one it hands on (``stages.gae``)."""
        return self.iter_dir(k) / "kl_ctrl.json"

    def retry_record(self, k: int) -> Path:
        """A KL-breach retry's decision for iteration k (``run.lifecycle.record_retry``): the scale of
        the reward's KL coefficient k's gae applies (its one source besides the controller's state)."""
        return self.iter_dir(k) / "retry.json"

    def validation(self, k: int) -> Path:
        return self.iter_dir(k) / "validation.parquet"

    def base_validation(self) -> Path:
        """The warm start's base model (actor_rollout_ref.model.path) validated beside the initial
        policy, once (``stages.validate``, warm_start.validate_base): the accuracy before the SFT."""
        return self.iter_dir(0) / "validation_base.parquet"

    def iteration_metrics(self, k: int) -> Path:
        return self.iter_dir(k) / "iteration_metrics.json"

    def launch_log(self, name: str) -> Path:
        """torchrun's whole output of a multi-process launch (``name``: 'update-iter_3', 'worker-group'):
        an error says what failed in one line and names this file for the rest."""
        return self.root / "logs" / f"{name}.log"

    def stage_ranks_dir(self, k: int, stage: str) -> Path:
        """Scratch of a stage run on several local processes (``stages.ranks``): the config they
        read and each rank's share of the outputs, removed once merged."""
        return self.iter_dir(k) / f".{stage}_ranks"

    def stage_ranks_config(self, k: int, stage: str) -> Path:
        """The config a stage's local processes read."""
        return self.stage_ranks_dir(k, stage) / "config.yaml"

    def stage_rank_share(self, k: int, stage: str, rank: int) -> Path:
        """Process ``rank``'s share of the stage's outputs (complete once it exists)."""
        return self.stage_ranks_dir(k, stage) / f"rank{rank}.npz"

    def published_weights(self, k: int, n: int) -> Path:
        """Copy ``n`` of iteration ``k``'s weights, written by the update's worker group for a stage
        of the flow process that loads them itself (``training.group_trainer.GroupTrainer``); removed when
        the group's state moves on. Holds ``actor/`` and ``critic/`` model directories."""
        return self.iter_dir(k) / f".published{n}"

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

    # run directories of format 1 (read only by run.migrate) --------------------------------------
    @property
    def legacy_kl_ctrl_path(self) -> Path:
        """Format 1: the run's one KL controller state, rewritten by every gae."""
        return self.root / "kl_ctrl.json"

    def legacy_kl_snapshot(self, k: int) -> Path:
        """Format 1: the KL controller state iteration k started from."""
        return self.iter_dir(k) / "kl_ctrl_before.json"

    # small state ------------------------------------------------------------------------------
    def read_json(self, path: Path, default: Any = None) -> Any:
        """The JSON object in ``path`` (``default`` when absent). A damaged file — bytes that are not
        UTF-8, text that is not JSON, JSON that is not an object (every state file holds one) —
        raises ``StateFileError`` naming it."""
        if not path.is_file():
            return default
        try:
            value = json.loads(path.read_bytes().decode("utf-8"))
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise StateFileError(f"{path} is damaged (not JSON: {exc})") from None
        if not isinstance(value, dict):
            raise StateFileError(f"{path} is damaged (it holds {json_kind(value)}, not a JSON object)")
        return value

    def append_event(self, kind: str, iteration: Optional[int] = None, **fields: Any) -> dict:
        """Append one event line (rollback, alert, skipped step). Appends of one short line are
        atomic enough on POSIX; after a torn last line (a writer killed mid-append) the new line
        starts on a line of its own, so only the torn one is lost."""
        event = {"time": time.time(), "kind": kind, "iteration": iteration, **fields}
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.events_path, "ab") as fh:
            torn = fh.tell() > 0 and not _ends_with_newline(self.events_path)
            fh.write(("\n" if torn else "").encode() + json.dumps(event, default=str).encode() + b"\n")
        return event

    def events(self) -> list[dict]:
        """Every event, in order. A damaged line (not UTF-8, not a JSON object; a torn last line) is
        skipped, and said once per process in one warning line naming the file and the line."""
        if not self.events_path.is_file():
            return []
        out, damaged = [], []
        for number, raw in enumerate(self.events_path.read_bytes().split(b"\n"), start=1):
            if not raw.strip():
                continue
            try:
                event = json.loads(raw.decode("utf-8"))
            except (ValueError, RecursionError) as exc:
                damaged.append((number, f"{type(exc).__name__}: {exc}"))
                continue
            if isinstance(event, dict):
                out.append(event)
            else:
                damaged.append((number, f"{json_kind(event)}, not a JSON object"))
        if damaged:
            _warn_once(self.events_path, damaged)
        return out


def json_kind(value: Any) -> str:
    """What a parsed JSON value is, in JSON's words ('a list', 'null', 'a number', ...)."""
    if value is None:
        return "null"
    kinds = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object"}
    return kinds.get(type(value), type(value).__name__)


_WARNED: set[tuple[str, tuple[int, ...]]] = set()


def _warn_once(path: Path, damaged: list[tuple[int, str]]) -> None:
    """One warning line for the damaged lines of ``path`` (the first named, with why), once per process."""
    key = (str(path), tuple(number for number, _ in damaged))
    if key in _WARNED:
        return
    _WARNED.add(key)
    (first, why), more = damaged[0], len(damaged) - 1
    others = f" and {more} more line{'s' * (more > 1)}" if more else ""
    print(f"rlhf: warning: {path} line {first}{others} damaged ({why}); skipped, the other lines are read",
          file=sys.stderr)


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as fh:
        fh.seek(-1, os.SEEK_END)
        return fh.read(1) == b"\n"


CONFIG_SEAL = "# rlhf: sha256 of the lines below: "
"""The first line of every config.yaml rlhf writes: a hash of the rest, so a changed or lost line
is found when the run is read again (``run.saved_config``). A YAML comment: the file stays a preset."""


def _seal(body: str) -> str:
    return hashlib.sha256(body.encode()).hexdigest()


def write_config(run: RunDir, cfg_yaml: str) -> None:
    """Write the run's config.yaml, sealed (``CONFIG_SEAL``)."""
    atomic_write_text(run.config_path, f"{CONFIG_SEAL}{_seal(cfg_yaml)}\n{cfg_yaml}")


def read_config_text(run: RunDir) -> tuple[str, Optional[str]]:
    """(config.yaml's text, why it is not what rlhf wrote: None when its seal verifies). Bytes that
    are not UTF-8 are replaced (and the seal then fails)."""
    text = run.config_path.read_bytes().decode("utf-8", errors="replace")
    first, _, body = text.partition("\n")
    if not first.startswith(CONFIG_SEAL):
        return text, "has no seal line (it was not written by this version of rlhf, or its first line was lost)"
    if first[len(CONFIG_SEAL):].strip() != _seal(body):
        return body, "was changed since rlhf wrote it (its content no longer matches its seal line)"
    return body, None


def require_run_dir(path: Path) -> None:
    """Refuse a path that is not a run directory (no config.yaml), naming where runs live."""
    if not RunDir(path).config_path.is_file():
        raise RLHFError(f"{path} is not a run directory (no config.yaml); runs live under trainer.runs_root")
