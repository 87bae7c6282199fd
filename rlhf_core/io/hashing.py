"""Content hashes for manifests: a stage is skipped only when its inputs' bytes are unchanged."""

from __future__ import annotations

import hashlib
from pathlib import Path

from rlhf_core.io.timing import HASHING, timed

_CHUNK = 1 << 20


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256_tree(path: str | Path) -> str:
    """Hash of a file, or of a directory's relative names and file contents (order-independent)."""
    path = Path(path)
    with timed(HASHING):
        if path.is_file():
            return sha256_file(path)
        h = hashlib.sha256()
        for p in sorted(q for q in path.rglob("*") if q.is_file()):
            h.update(str(p.relative_to(path)).encode())
            h.update(sha256_file(p).encode())
        return h.hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
