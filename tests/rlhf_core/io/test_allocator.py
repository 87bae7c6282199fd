"""Freed host memory stays the process's (``rlhf_core.io.allocator``): the same tensor work faults
in far fewer fresh pages, which is where the update stage's time went at a real layer shape."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rlhf_core.io.allocator import ENV

LOOP = """
import resource, sys, torch
from rlhf_core.io.allocator import keep_freed_memory
applied = keep_freed_memory()
torch.set_num_threads(1)
a, w = torch.randn(944, 896), torch.randn(896, 4864)  # one MLP projection of 8 x 118 tokens, Qwen2.5-0.5B's width
def step():
    y = a @ w
    return float((torch.nn.functional.silu(y) * y)[0, 0])
for _ in range(3):  # the heap grows to the loop's size
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


EAGER = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
"""glibc's default thresholds, fixed: every block over 128 KB mapped on its own and unmapped on free.
Left adaptive, glibc sometimes keeps a loop's blocks by itself, depending on what the heap held
before; fixed, the baseline faults every block in on every step."""


def _faults(keep: bool) -> tuple[int, str]:
    """(fresh pages faulted in by ten steps, whether the setting took) in a process of its own."""
    out = subprocess.run([sys.executable, "-c", LOOP], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **EAGER, ENV: "1" if keep else "0"})
    assert out.returncode == 0, out.stderr[-2000:]
    applied, faults = out.stdout.split()[-2:]
    return int(faults), applied


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_kept_memory_faults_in_a_fraction_of_the_pages():
    default, applied_default = _faults(keep=False)
    kept, applied = _faults(keep=True)
    assert applied == "True" and applied_default == "False"  # RLHF_KEEP_FREED_MEMORY=0 leaves glibc's defaults
    assert kept < default / 2, (kept, default)
