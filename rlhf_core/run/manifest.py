"""Per-scope manifests: what each stage read, wrote and measured.

A manifest (``manifest.json`` at the run root for setup stages, ``iter_<k>/manifest.json`` per
iteration) maps stage name → record::

    {"status": "done" | "stale" | "rolled_back" | "failed",
     "inputs": {relpath: sha256}, "outputs": {relpath: sha256}, "config_hash": str,
     "rows": {name: int}, "metrics": {name: float}, "seconds": float,
     "io_seconds": float, "io": {kind: float},
     "started_at": float, "finished_at": float}

``seconds`` is the stage body's wall time; ``io_seconds`` the part of it spent loading models,
writing checkpoints and tables, hashing, releasing memory (``rlhf_core.io.timing``), by kind in ``io``.

A stage is up to date when its record is ``done``, its recorded input hashes and config hash match
the current ones, and its outputs still hash to what was recorded.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

from rlhf_core.io.atomic import atomic_write_json
from rlhf_core.io.hashing import sha256_tree
from rlhf_core.run.layout import RunDir, StateFileError, json_kind
from rlhf_core.run.stage_order import DOWNSTREAM, SETUP_STAGES
from rlhf_core.io.timing import MANIFEST, timed


STATE_DIGEST = "state:"
"""How a recorded digest names a checkpoint by the lineage id of its state (``path_digest``)."""


def read_manifest(run: RunDir, iteration: Optional[int]) -> dict[str, Any]:
    """Stage name → record; {} when there is none. A damaged manifest (not a JSON object of objects)
    raises ``StateFileError`` naming it."""
    path = run.manifest_path(iteration)
    with timed(MANIFEST):
        manifest = run.read_json(path, default={})
    for stage, record in manifest.items():
        if not isinstance(record, dict):
            raise StateFileError(f"{path} is damaged (the record of {stage!r} is {json_kind(record)}, not a JSON "
                                 "object)")
    return manifest


def write_manifest(run: RunDir, iteration: Optional[int], manifest: dict[str, Any]) -> None:
    with timed(MANIFEST):
        atomic_write_json(run.manifest_path(iteration), manifest)


def path_digest(run: RunDir, path: Path) -> Optional[str]:
    """The content identity of a stage input or output: sha256 of the file or directory, except for
    an iteration's checkpoint (or a directory inside it), which is named by the lineage id of the
    state the update produced (``iter_k/state.json``, ``training.resident``). That id is the same
    whether the checkpoint is on disk, held in memory or still to be rebuilt, and it costs nothing to
    read: weight files are hashed once, while the checkpoint is written, never at a stage read.
    None when the path does not exist (and is no such state)."""
    k = run.checkpoint_iteration(path)
    if k is not None:
        record = run.read_json(run.state_record(k))
        if record and record.get("id"):
            inside = Path(path).resolve().relative_to(run.checkpoint(k).resolve())
            return f"{STATE_DIGEST}{record['id']}" + ("" if str(inside) == "." else f"/{inside}")
    if not Path(path).exists():
        return None
    return sha256_tree(path)


def hash_paths(run: RunDir, paths: list[Path]) -> dict[str, str]:
    """{path relative to the run (or absolute when outside it): digest (``path_digest``)}; a missing
    path raises."""
    out = {}
    for p in paths:
        p = Path(p).resolve()
        digest = path_digest(run, p)
        if digest is None:
            raise FileNotFoundError(f"stage input {p} does not exist: run the stage that produces it first")
        out[record_key(run, p)] = digest
    return out


def record_key(run: RunDir, path: str | Path) -> str:
    """How a record names a path: relative to the run directory, absolute outside it."""
    p = Path(path).resolve()
    return str(p.relative_to(run.root)) if p.is_relative_to(run.root) else str(p)


def is_up_to_date(run: RunDir, iteration: Optional[int], stage: str, inputs: dict[str, str],
                  cfg_hash: str) -> bool:
    record = read_manifest(run, iteration).get(stage)
    if not record or record.get("status") != "done":
        return False
    if record.get("inputs") != inputs or record.get("config_hash") != cfg_hash:
        return False
    for rel, digest in record.get("outputs", {}).items():
        path = Path(rel) if Path(rel).is_absolute() else run.root / rel
        if path_digest(run, path) != digest:
            return False
    return True


def record_stage(run: RunDir, iteration: Optional[int], stage: str, **record: Any) -> dict:
    manifest = read_manifest(run, iteration)
    record.setdefault("finished_at", time.time())
    manifest[stage] = record
    write_manifest(run, iteration, manifest)
    return record


def set_status(run: RunDir, iteration: Optional[int], stage: str, status: str, **extra: Any) -> None:
    manifest = read_manifest(run, iteration)
    if stage in manifest:
        manifest[stage].update(status=status, **extra)
        write_manifest(run, iteration, manifest)


def mark_downstream_stale(run: RunDir, iteration: Optional[int], stage: str) -> list[str]:
    """After ``stage`` reran, everything computed from its old outputs is stale: the later setup
    stages, or the iteration's ``DOWNSTREAM`` stages, and every stage of later iterations. Returns
    what was marked."""
    marked = []
    if iteration is None:
        later = SETUP_STAGES[SETUP_STAGES.index(stage) + 1:] if stage in SETUP_STAGES else ()
        scope_iters = run.iterations()
    else:
        later, scope_iters = DOWNSTREAM.get(stage, ()), [k for k in run.iterations() if k > iteration]
    manifest = read_manifest(run, iteration)
    for name in later:
        if manifest.get(name, {}).get("status") == "done":
            manifest[name]["status"] = "stale"
            marked.append(name if iteration is None else f"iter_{iteration}/{name}")
    if marked:
        write_manifest(run, iteration, manifest)
    for k in scope_iters:
        m = read_manifest(run, k)
        changed = False
        for name, rec in m.items():
            if rec.get("status") == "done":
                rec["status"] = "stale"
                marked.append(f"iter_{k}/{name}")
                changed = True
        if changed:
            write_manifest(run, k, m)
    return marked


def mark_skipped(run: RunDir, k: Optional[int], stage: str) -> None:
    """Note that the last invocation of ``stage`` reused its outputs (shown as 'skipped')."""
    manifest = read_manifest(run, k)
    if stage in manifest:
        manifest[stage]["skipped_at"] = time.time()
        write_manifest(run, k, manifest)
