"""A directory's sha256 manifest (``manifest.json``: {"files": {relative path: {"sha256", "bytes"}}})
and its check: how a checkpoint is sealed when written and verified before anything is loaded.

A checkpoint writer hashes its large files while writing them (``io.safetensors_stream``) and
hands those digests to ``write_manifest``; only files it did not record (small ones that other
libraries write, such as a tokenizer's) are read back and hashed here. Plain file hashing, no
torch, so deciding which checkpoint is intact is cheap to import."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from rlhf_core.errors import CheckpointError
from rlhf_core.io.hashing import sha256_file

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def write_manifest(directory: Path, recorded: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Seal ``directory``: manifest.json lists every file under it. ``recorded`` = {relative path:
    {"sha256", "bytes"}} hashed while written (not read again; a size that disagrees with the file
    on disk is a writer bug and raises); any other file is hashed here."""
    files = {}
    for p in sorted(q for q in directory.rglob("*") if q.is_file() and q.name != MANIFEST):
        rel = p.relative_to(directory).as_posix()
        size = p.stat().st_size
        entry = recorded.get(rel)
        if entry is None:
            entry = {"sha256": sha256_file(p), "bytes": size}
        elif int(entry["bytes"]) != size:
            raise RuntimeError(f"{p}: {size} bytes on disk, {entry['bytes']} recorded while writing")
        files[rel] = {"sha256": str(entry["sha256"]), "bytes": int(entry["bytes"])}
    missing = sorted(set(recorded) - set(files))
    if missing:
        raise RuntimeError(f"{directory}: files recorded while writing are not there: {missing}")
    manifest = {"format": FORMAT_VERSION, "files": files}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def write_checksums(directory: Path) -> dict[str, Any]:
    """Seal ``directory`` by reading and hashing every file (for writers that record nothing)."""
    return write_manifest(directory, {})


def verify_checkpoint(directory: str | Path) -> dict[str, Any]:
    """Check every file listed in the manifest (present, full size, same sha256); returns the
    manifest. Raises ``CheckpointError`` naming the first bad file and what is wrong with it."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: {directory} is not a complete checkpoint (an interrupted "
                              "write leaves none); rerun the update stage that writes it")
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
        files = manifest["files"]
        if not isinstance(files, dict) or not all(
                isinstance(e, dict) and isinstance(e.get("bytes"), int) and isinstance(e.get("sha256"), str)
                for e in files.values()):
            raise TypeError('its "files" are not {name: {"bytes": N, "sha256": "..."}}')
    except (ValueError, KeyError, TypeError) as exc:  # ValueError: not UTF-8, not JSON
        raise CheckpointError(f"{path} is corrupt ({exc}); rerun the update stage that writes it") from None
    for rel, entry in sorted(files.items()):
        f = directory / rel
        if not f.is_file():
            raise CheckpointError(f"checkpoint file {f} is missing (listed in {path}); the checkpoint is "
                                  "incomplete: rerun the update stage or roll back to another checkpoint")
        size = f.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(f"checkpoint file {f} is truncated or altered: {size} bytes, the manifest "
                                  f"says {entry['bytes']}; rerun the update stage or roll back")
        if sha256_file(f) != entry["sha256"]:
            raise CheckpointError(f"checkpoint file {f} is corrupt: its sha256 does not match {path}; "
                                  "rerun the update stage or roll back")
    return manifest
