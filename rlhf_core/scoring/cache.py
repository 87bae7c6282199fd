"""An in-process cache of read-only models, so the stages of one process (the pipeline flow runs
them all in one) load each model directory at most once.

Why it is safe: the models it serves never change under their key. The reference / initial policy
is never written; a checkpoint directory is written once (atomically, by renaming a finished
temporary directory into place) and a rollback or prune renames it away rather than editing it.
Each lookup compares the directory's identity now — (name, size, mtime_ns, inode) of every file in
it — with the identity it had when loaded: a removed, renamed-away or rewritten directory never
matches, so a rolled-back checkpoint is never served, and an iteration's new checkpoint at the same
path is loaded afresh. A fresh process (a CLI rerun of one stage) starts empty.

What it serves is shared: models in eval mode with gradients off. Only inference code (rollout,
score, guard, validation) asks for it (``shared=True``); the update stage loads its own models to
train. Callers must not change a shared model's weights or modules.

Bounded: at most ``MAX_ENTRIES`` objects and ``RLHF_MODEL_CACHE_MB`` megabytes of parameters
(default 1024 on CPU; 0 on CUDA, where the update needs the device memory the cached models would
hold; ``RLHF_MODEL_CACHE_MB=0`` turns it off everywhere). Least recently used goes first.
"""

from __future__ import annotations

import collections
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

MAX_ENTRIES = 6
"""Reference, the actor an iteration starts from, the actor it trains, their tokenizers."""
DEFAULT_CPU_MB = 1024
BUDGET_ENV = "RLHF_MODEL_CACHE_MB"


@dataclass
class _Entry:
    identity: tuple
    obj: Any
    nbytes: int


_entries: "collections.OrderedDict[tuple, _Entry]" = collections.OrderedDict()


def budget_bytes(device_type: str) -> int:
    """The cache's size limit for models on ``device_type`` ('cpu' or 'cuda')."""
    raw = os.environ.get(BUDGET_ENV)
    if raw is None:
        return DEFAULT_CPU_MB * 2 ** 20 if device_type == "cpu" else 0
    try:
        return int(float(raw) * 2 ** 20)
    except ValueError:
        raise ValueError(f"{BUDGET_ENV}={raw!r} is not a number of megabytes (0 turns the model cache off)") from None


def directory_identity(path: Path) -> Optional[tuple]:
    """(name, size, mtime_ns, inode) of every file directly in ``path``; None when it is gone."""
    try:
        with os.scandir(path) as it:
            files = [(e.name, e.stat()) for e in it if e.is_file()]
    except OSError:
        return None
    return tuple(sorted((name, st.st_size, st.st_mtime_ns, st.st_ino) for name, st in files))


def parameter_bytes(obj: Any) -> int:
    """Bytes of a model's parameters and buffers (0 for a tokenizer)."""
    if not hasattr(obj, "parameters"):
        return 0
    tensors = [*obj.parameters(), *obj.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def shared(kind: str, path: Path, device_type: str, options: tuple, load: Callable[[], Any]) -> Any:
    """The object ``load()`` returns for directory ``path``, from the cache while the directory is
    unchanged. ``kind`` and ``options`` (dtype, device, attention, ...) complete the key."""
    budget = budget_bytes(device_type)
    if budget <= 0:
        return load()
    path = Path(path).resolve()
    key = (kind, str(path), device_type, options)
    identity = directory_identity(path)
    entry = _entries.get(key)
    if entry is not None and identity is not None and entry.identity == identity:
        _entries.move_to_end(key)
        return entry.obj
    _entries.pop(key, None)
    _forget_missing()
    obj = load()
    if identity is None or directory_identity(path) != identity:  # changed while loading: not cacheable
        return obj
    size = parameter_bytes(obj)
    if size <= budget:
        _entries[key] = _Entry(identity, obj, size)
        _evict(budget)
    return obj


def holds(obj: Any) -> bool:
    """Whether ``obj`` is in the cache (then dropping a reference to it frees nothing)."""
    return any(entry.obj is obj for entry in _entries.values())


def clear() -> None:
    _entries.clear()


def _forget_missing() -> None:
    """Drop entries whose directory is gone (a discarded or pruned checkpoint): free their memory now."""
    for key in [k for k, e in _entries.items() if directory_identity(Path(k[1])) != e.identity]:
        del _entries[key]


def _evict(budget: int) -> None:
    while _entries and (len(_entries) > MAX_ENTRIES or sum(e.nbytes for e in _entries.values()) > budget):
        _entries.popitem(last=False)
