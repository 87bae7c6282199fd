"""Host memory the process has freed stays the process's: glibc's allocator is told not to hand it
back to the kernel after every free.

Why: by default glibc returns the top of its heap to the kernel once more than 128 KB are free there
(``M_TRIM_THRESHOLD``) and serves blocks above an adaptive threshold with fresh ``mmap``s unmapped
again on free. A PPO update allocates and frees activations of tens of MB for every layer of every
forward and backward; each new block is then zero pages the kernel must fault in one 4 KB page at a
time — measured at Qwen2.5-0.5B's layer shape × 4 (benchmarks/bench_real_shape.py, docs/benchmarks.md
§8): the update stage 7.2 s with glibc's defaults, 4.8 s with freed memory kept, the same floating-point
work and bit-identical results. Scoring, the KL guard and generation gain the same way, less.

What it costs: the process's resident memory no longer shrinks back after a peak (the peak itself is
unchanged; ``training.memory`` budgets the peak). Blocks above ``MMAP_THRESHOLD`` (weights, optimizer
state: allocated once and kept) are still mapped on their own.

Only glibc (Linux) has ``mallopt``; elsewhere this does nothing. ``RLHF_KEEP_FREED_MEMORY=0`` keeps
glibc's defaults.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2 ** 20
"""Blocks up to this size come from the heap (glibc's largest allowed value on 64-bit)."""
TRIM_THRESHOLD = 2 ** 31 - 1
"""Free memory at the heap's top kept up to this (mallopt's largest value: 2 GB)."""
ENV = "RLHF_KEEP_FREED_MEMORY"


def keep_freed_memory() -> bool:
    """Tell glibc to keep freed memory in this process (see the module docstring); True when it
    took effect. Harmless to repeat; call it at a process's start, before the heavy work."""
    if os.environ.get(ENV, "1") == "0":
        return False
    try:  # the running program's own symbols, libc's among them: no search for the library file
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (macOS; musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
