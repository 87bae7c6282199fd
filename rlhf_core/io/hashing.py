"""Content hashes for manifests: a stage is skipped only when its inputs' bytes are unchanged."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from rlhf_core.io.timing import HASHING, timed

_CHUNK = 1 << 20
_known: dict[tuple, str] = {}
"""sha256 by (path, size, mtime_ns, inode, ctime_ns): a file this process hashed and that nobody
rewrote since is not read again. Every stage of a flow run names the initial model, the reference
and the prompt tables among its inputs; without this each stage re-read them (a second per GB).
Writers here replace files by rename (a new inode), and an in-place rewrite moves mtime/ctime."""


def sha256_file(path: str | Path) -> str:
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)
    known = _known.get(key)
    if known is not None:
        return known
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    digest = _known[key] = h.hexdigest()
    return digest


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
