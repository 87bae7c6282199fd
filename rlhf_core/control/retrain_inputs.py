"""Retraining inputs: the model a retraining run starts from and a frozen copy of its prompt data;
``run.inputs.check_inputs`` then checks that every path the config names exists before any work starts.

A scheduled retrain (flows/retrain.py, deployment ``rlhf-retrain``) must be reproducible and must
never write into an earlier run, so it

    base = resolve_base_model("last-exported", runs_root, cfg)   # newest RUN/export/actor (export.json)
    name = retrain_run_name("retrain", flow_run_id)              # retrain-20261130-030000-1a2b3c4d
    files = snapshot_files(cfg.data.train_files, runs_root / "snapshots" / name)
    check_inputs(cfg_with_base_and_snapshot)                     # ConfigError listing every missing path

The snapshot lives beside the run directory (``<runs_root>/snapshots/<run name>/``) because the
pipeline creates the run directory itself and refuses one that is not empty; the run's config.yaml
points at the copies, and ``snapshot.json`` records each source path, size and sha256. No Prefect here.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

from rlhf_core.config import ConfigError, RLHFConfig
from rlhf_core.io.atomic import atomic_path, atomic_write_json
from rlhf_core.io.hashing import sha256_file
from rlhf_core.paths import resolve_path

LAST_EXPORTED = "last-exported"
"""Base model spec: the newest export under trainer.runs_root."""
FROM_CONFIG = "config"
"""Base model spec: whatever actor_rollout_ref.model.path the preset and overrides say."""
SNAPSHOTS_DIR = "snapshots"
"""Folder under trainer.runs_root holding one data snapshot per retraining run."""


@dataclass(frozen=True)
class ExportInfo:
    """One exported actor (``RUN/export/actor``) and where it came from."""

    path: Path
    run_dir: Path
    iteration: Optional[int]
    val_accuracy: Optional[float]
    time: float

    def to_dict(self) -> dict:
        return {**asdict(self), "path": str(self.path), "run_dir": str(self.run_dir)}


def runs_root_of(cfg: RLHFConfig) -> Path:
    """trainer.runs_root as an absolute path (relative to the current directory, as the pipeline does)."""
    return Path(cfg.trainer.runs_root).expanduser().resolve()


def find_exports(runs_root: str | Path) -> list[ExportInfo]:
    """Every export written by ``rlhf export`` / the pipeline's export step under ``runs_root``
    (``*/export/actor/export.json``), oldest first. Unreadable records are skipped: an export is
    written atomically, so a broken record is not an export."""
    found = []
    for record_path in Path(runs_root).glob("*/export/actor/export.json"):
        try:
            record = json.loads(record_path.read_bytes().decode("utf-8"))
        except (OSError, ValueError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            continue
        if not isinstance(record, dict):
            continue
        actor = record_path.parent
        found.append(ExportInfo(path=actor, run_dir=actor.parent.parent, iteration=record.get("iteration"),
                                val_accuracy=record.get("val_accuracy"),
                                time=float(record.get("time") or record_path.stat().st_mtime)))
    return sorted(found, key=lambda e: (e.time, str(e.path)))


def latest_export(runs_root: str | Path) -> Optional[ExportInfo]:
    exports = find_exports(runs_root)
    return exports[-1] if exports else None


def resolve_base_model(spec: str, runs_root: str | Path, cfg: RLHFConfig) -> tuple[str, Optional[ExportInfo]]:
    """The model a retraining run starts from: (path or 'tiny', the export it is, if any).

    ``spec``: 'last-exported' (newest export under runs_root), 'config' (the preset's model.path),
    'tiny', or a model directory. Raises ConfigError saying what to do when nothing matches."""
    spec = spec.strip()
    if spec == LAST_EXPORTED:
        export = latest_export(runs_root)
        if export is None:
            raise ConfigError(
                f"base_model='{LAST_EXPORTED}': no exported model under {runs_root} (exports are "
                "RUN/export/actor, written when a run's validation accuracy clears "
                "trainer.export_min_val_score). Run rlhf-train first, or set base_model to a model "
                "directory, 'tiny', or 'config' (the preset's actor_rollout_ref.model.path)")
        return str(export.path), export
    if spec == FROM_CONFIG:
        return cfg.actor_rollout_ref.model.path, None
    if spec == "tiny":
        return "tiny", None
    path = resolve_path(spec)
    if not (path / "config.json").is_file():
        raise ConfigError(f"base_model={spec!r}: {path} is not a Hugging Face model directory (no config.json); "
                          f"give a model directory, '{LAST_EXPORTED}', 'config' or 'tiny'")
    return str(path), None


def retrain_run_name(prefix: str, flow_run_id: Optional[str] = None, now: Optional[float] = None) -> str:
    """``<prefix>-<UTC timestamp>-<8 hex of the flow run id>``: two runs never share a directory, even
    when started in the same second (the id part is random when there is no flow run)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    token = (flow_run_id or uuid.uuid4().hex).replace("-", "")[:8]
    return f"{prefix}-{stamp}-{token}"


def snapshot_files(files: Sequence[str], dest: str | Path, key: str = "data.train_files") -> list[dict]:
    """Copy each prompt file into ``dest`` (atomically, name prefixed by its position so equal base
    names never collide; the suffix is kept because readers dispatch on it) and record
    ``dest/snapshot.json``. Returns [{"source", "path", "sha256", "bytes"}] in input order.

    The hash is taken of the copy, so it describes exactly the bytes the run reads."""
    dest = Path(dest)
    missing = [f for f in files if not resolve_path(f).is_file()]
    if missing:
        raise ConfigError(f"{key}: file(s) not found: {', '.join(missing)}; give JSONL, Parquet or CSV paths "
                          "(absolute, or relative to the current directory or the project root)")
    entries = []
    for i, name in enumerate(files):
        source = resolve_path(name)
        target = dest / f"{i:02d}-{source.name}"
        with atomic_path(target) as tmp:
            shutil.copyfile(source, tmp)
        entries.append({"source": str(source), "path": str(target), "sha256": sha256_file(target),
                        "bytes": target.stat().st_size})
    atomic_write_json(dest / "snapshot.json", {"key": key, "files": entries, "time": time.time()})
    return entries
