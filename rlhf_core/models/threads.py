"""How many CPU threads a model's work gets, by the size of its matmuls, not its parameter count.

A model whose largest weight matrix has fewer than ``SMALL_MATMUL`` elements (the demo's tiny model:
64 x 176) runs each operation on one thread: its matmuls are too small to split, and on a shared
machine extra OpenMP threads spin-wait (tiny model: decoding 3,600 tokens/s on 1 thread vs 220 on 2
busy cores; 4 update steps 0.18 s on 1 thread vs 13 s on 2). A model with real layer shapes splits
each matmul over the cores even when it has few layers: at Qwen2.5-0.5B's shape (896 x 4864) cut to 4
layers (60 M parameters) decoding 8 prompts of 86 tokens took 1.82 s on 2 threads vs 2.76 s on 1, and
the PPO update (critic then actor, 8 x 118 tokens) 4.8 s on 2 threads vs 5.5 s with the two roles
side by side on one thread each (benchmarks/bench_real_shape.py).
"""

from __future__ import annotations

from typing import Iterable, Sequence

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
