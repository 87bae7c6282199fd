"""A directory's sha256 manifest (``manifest.json``: {"files": {relative path: {"sha256", "bytes"}}})
and its check: how a checkpoint is sealed when written and verified before anything is loaded.
Plain file hashing, no torch, so deciding which checkpoint is intact is cheap to import."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlhf_core.errors import CheckpointError
from rlhf_core.io.hashing import sha256_file

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def write_checksums(directory: Path) -> dict[str, Any]:
    files = {}
    for p in sorted(q for q in directory.rglob("*") if q.is_file() and q.name != MANIFEST):
        files[str(p.relative_to(directory))] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    manifest = {"format": FORMAT_VERSION, "files": files}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def verify_checkpoint(directory: str | Path) -> dict[str, Any]:
    """Check every file listed in the manifest (present, full size, same sha256); returns the
    manifest. Raises ``CheckpointError`` naming the first bad file and what is wrong with it."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: {directory} is not a complete checkpoint (an interrupted "
                              "write leaves none); rerun the update stage that writes it")
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
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
