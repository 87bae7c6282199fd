"""How many CPU threads a model's work gets, by the size of its matmuls, not its parameter count.

A model whose largest weight matrix has fewer than ``SMALL_MATMUL`` elements (the demo's tiny model:
64 x 176) runs each operation on one thread: its matmuls are too small to split, and on a shared
machine extra OpenMP threads spin-wait (tiny model: decoding 3,600 tokens/s on 1 thread vs 220 on 2
busy cores; 4 update steps 0.18 s on 1 thread vs 13 s on 2). A model with real layer shapes splits
each matmul over the cores even when it has few layers: at Qwen2.5-0.5B's shape (896 x 4864) cut to 4
layers (60 M parameters) decoding 8 prompts of 86 tokens took 1.82 s on 2 threads vs 2.76 s on 1, and
the PPO update (critic then actor, 8 x 118 tokens) 4.8 s on 2 threads vs 5.5 s with the two roles
side by side on one thread each (benchmarks/bench_real_shape.py).

A background thread that does torch work (the rollback capture's copy, a checkpoint's write) runs it
on itself alone (``serial_background_thread``): its first parallel torch op would otherwise start a
second OpenMP team, and with more OpenMP threads than cores libgomp stops spin-waiting, so the main
thread's team sleeps and wakes at every parallel region for the rest of the process. At Qwen2.5-0.5B's
shape x 4 layers this slowed the rollout's generate from 1.69-1.73 s to 1.83-1.90 s an iteration after
the first capture, and the update and the guard by 2-4% (docs/benchmarks.md section 8).
"""

from __future__ import annotations

import ctypes
from typing import Iterable, Sequence

import torch

SMALL_MATMUL = 1_000_000
"""Elements of a model's largest weight matrix under which its work runs on one CPU thread."""


def largest_matrix(shapes: Iterable[Sequence[int]]) -> int:
    """Elements of the largest 2-D weight among ``shapes`` (0 when there is none)."""
    return max((int(a) * int(b) for a, b in (s for s in shapes if len(s) == 2)), default=0)


def config_largest_matrix(config: dict) -> int:
    """``largest_matrix`` of a decoder-only transformer from its Hugging Face config.json alone (no
    weights read): the embedding / LM head, the MLP and the attention projections. 0 when the config
    lacks the sizes."""
    try:
        hidden, vocab = int(config["hidden_size"]), int(config.get("vocab_size") or 0)
        inner = int(config.get("intermediate_size") or 0)
        heads = int(config.get("num_attention_heads") or 1)
        head_dim = int(config.get("head_dim") or hidden // heads)
    except (KeyError, TypeError, ValueError):
        return 0
    return largest_matrix([(vocab, hidden), (inner, hidden), (heads * head_dim, hidden)])


def module_largest_matrix(module) -> int:
    """``largest_matrix`` of a torch module's parameters (their full shapes under ZeRO-3)."""
    return largest_matrix(tuple(getattr(p, "ds_shape", p.shape)) for p in module.parameters())


def small_matmuls(largest: int) -> bool:
    """Whether a model with this largest weight matrix runs on one CPU thread."""
    return largest < SMALL_MATMUL


def serial_background_thread() -> bool:
    """Run the calling thread's own parallel torch ops on it alone, leaving every other thread's
    count as it is. Call it first thing in a background thread. ``torch.set_num_threads(1)`` would
    not do: it sets the process-wide count, and the main thread's next parallel region ran on one
    thread. So this lets torch set up the thread's OpenMP state from the process-wide count (its
    first query does), then lowers that one thread's OpenMP limit. Returns whether it took effect
    (False where torch runs without libgomp / Intel OpenMP exporting ``omp_set_num_threads``)."""
    torch.get_num_threads()
    try:
        limit = ctypes.CDLL(None).omp_set_num_threads
    except (OSError, AttributeError):
        return False
    limit.argtypes, limit.restype = [ctypes.c_int], None
    limit(1)
    return torch.get_num_threads() == 1
