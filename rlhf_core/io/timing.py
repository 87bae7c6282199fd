"""Where a stage's seconds go that are not compute: loading models, writing checkpoints and tables,
hashing, releasing memory.

The orchestration-overhead benchmark (benchmarks/bench_overhead.py) counts as compute only the
stage time that is *not* spent here, so every load and save a stage makes is wrapped::

    with timed("model_load"):
        model = AutoModelForCausalLM.from_pretrained(path)

``stages.base.stage_record`` opens a tally around the stage's work and records it in the manifest record as
``io_seconds`` (total) and ``io`` ({kind: seconds}). Outside a tally ``timed`` costs two clock reads.

Nested blocks count once, in the outermost (a checkpoint save that writes JSON through
``atomic_write_json`` is a checkpoint write, not a JSON write). ``opaque()`` hides inner blocks
entirely, for a callee that reports its own I/O seconds (``add``).

With ``keep_spans()`` every outermost block is also logged with its wall-clock start and end, so a
benchmark can attribute the bookkeeping around stage bodies (manifests, MLflow, Prefect artifacts)
to iterations; off by default.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import gc
import time
from dataclasses import dataclass
from typing import Iterator, Optional

# the I/O kinds the stages use (free-form strings; these keep the names consistent)
MODEL_LOAD = "model_load"
"""Model or tokenizer weights read from disk into memory (from_pretrained)."""
CHECKPOINT_WRITE = "checkpoint_write"
"""A checkpoint (weights, optimizer state) written to disk."""
UPDATE_SETUP = "update_setup"
"""The update's setup: process group, model loads, DeepSpeed engines, optimizer state (perf/setup_seconds)."""
TABLE_READ = "table_read"
TABLE_WRITE = "table_write"
JSON_WRITE = "json_write"
HASHING = "hashing"
"""Content hashes (manifest input/output hashes, weight fingerprints)."""
MANIFEST = "manifest"
"""Reading and writing the stage manifests."""
MEMORY_RELEASE = "memory_release"
"""A full garbage collection to give a freed model's memory back before the next one loads."""
GC_PAUSE = "gc_pause"
"""Python's automatic full (generation 2) collections: they stop the process wherever they strike;
counted apart, not as compute, when they fall outside every ``timed`` block."""


@dataclass
class Span:
    kind: str
    start: float
    """Wall clock (time.time()) at entry."""
    end: float
    in_stage: bool
    """Inside a stage body (then already in that stage's manifest ``io``)."""
    background: bool = False
    """Logged by a background thread (``background()``): overlaps the critical path, not on it."""


_tally: contextvars.ContextVar[Optional[dict[str, float]]] = contextvars.ContextVar("rlhf_io_tally", default=None)
_busy: contextvars.ContextVar[bool] = contextvars.ContextVar("rlhf_io_busy", default=False)
_background: contextvars.ContextVar[bool] = contextvars.ContextVar("rlhf_io_background", default=False)
_spans: Optional[collections.deque] = None
MAX_SPANS = 100_000
# For the garbage-collector callback, which runs in whichever thread allocated last: the innermost
# open tally and the number of open timed/opaque blocks, process-wide (stages run one at a time).
_gc_sink: Optional[dict[str, float]] = None
_blocks_open = 0
_gc_started: Optional[float] = None


@contextlib.contextmanager
def timed(kind: str) -> Iterator[None]:
    """Count the block's seconds as non-compute time of ``kind`` (see the module docstring)."""
    global _blocks_open
    if _busy.get():
        yield
        return
    token = _busy.set(True)
    _blocks_open += 1
    wall, started = time.time(), time.perf_counter()
    try:
        yield
    finally:
        _busy.reset(token)
        _blocks_open -= 1
        seconds = time.perf_counter() - started
        tally = _tally.get()
        if tally is not None:
            tally[kind] = tally.get(kind, 0.0) + seconds
        if _spans is not None:
            _spans.append(Span(kind, wall, wall + seconds, tally is not None, _background.get()))


@contextlib.contextmanager
def opaque() -> Iterator[None]:
    """Blocks inside are not counted: the callee reports its own I/O seconds (then ``add`` them)."""
    global _blocks_open
    token = _busy.set(True)
    _blocks_open += 1
    try:
        yield
    finally:
        _busy.reset(token)
        _blocks_open -= 1


@contextlib.contextmanager
def span(kind: str) -> Iterator[None]:
    """Log the block as a span (when ``keep_spans`` is on) without counting it or hiding what is
    inside: marks a whole call (a Prefect task's function, a stage with its bookkeeping)."""
    if _spans is None:
        yield
        return
    wall, started = time.time(), time.perf_counter()
    try:
        yield
    finally:
        if _spans is not None:
            _spans.append(Span(kind, wall, wall + time.perf_counter() - started, _tally.get() is not None,
                               _background.get()))


@contextlib.contextmanager
def background() -> Iterator[None]:
    """Mark the spans logged inside (in this context) as background work: a reporter thread's
    MLflow and artifact calls overlap the next iteration instead of lengthening it."""
    token = _background.set(True)
    try:
        yield
    finally:
        _background.reset(token)


def add(kind: str, seconds: float) -> None:
    """Count seconds measured elsewhere (e.g. a training loop's checkpoint time) into the open tally."""
    tally = _tally.get()
    if tally is not None and seconds > 0:
        tally[kind] = tally.get(kind, 0.0) + float(seconds)


@contextlib.contextmanager
def tally() -> Iterator[dict[str, float]]:
    """Collect the ``timed`` seconds of the block into the yielded {kind: seconds} (a stage body)."""
    global _gc_sink
    counts: dict[str, float] = {}
    token = _tally.set(counts)
    outer_sink, _gc_sink = _gc_sink, counts
    try:
        yield counts
    finally:
        _tally.reset(token)
        _gc_sink = outer_sink


def keep_spans(enable: bool = True) -> None:
    """Start (or stop) logging outermost blocks with their wall-clock times; starting clears the log."""
    global _spans
    _spans = collections.deque(maxlen=MAX_SPANS) if enable else None


def spans() -> list[Span]:
    return list(_spans or ())


def _on_gc(phase: str, info: dict) -> None:
    """gc.callbacks hook: time full collections that no timed block already covers."""
    global _gc_started
    if info.get("generation") != 2:
        return
    if phase == "start":
        _gc_started = time.perf_counter()
        return
    if _gc_started is None:
        return
    seconds, _gc_started = time.perf_counter() - _gc_started, None
    if _blocks_open:
        return
    if _gc_sink is not None:
        _gc_sink[GC_PAUSE] = _gc_sink.get(GC_PAUSE, 0.0) + seconds
    if _spans is not None:
        now = time.time()
        _spans.append(Span(GC_PAUSE, now - seconds, now, _gc_sink is not None))


if _on_gc not in gc.callbacks:
    gc.callbacks.append(_on_gc)
