"""What this machine computes with: its CPU (model, flags), how fast it multiplies matrices in each
dtype, and so whether bf16 pays on it.

The rate (``device_rate``): on a GPU its dense bf16/fp16 peak from ``GPU_PEAKS`` (as verl does), else
measured once per process in this dtype. On a CPU: one core's matmul rate — a 944 x 896 x 4864 product
(the MLP's shape at Qwen2.5-0.5B's width, a 944-token micro-batch) on one thread, timed by that thread's
CPU time, best of five (~0.3 s in fp32) — times the physical cores: what every core multiplying at once
would reach. Wall-clock timing on all cores at once came out, on a machine shared with other work, below
what the score stage then achieved (60 GFLOP/s measured on 2 busy cores against 69 reached), which no
floor may be; a thread's CPU time only counts while it runs, so other work on the machine does not
lower the rate (only what it does to the caches).

Whether bf16 pays on a CPU (``cpu_bf16_pays``) is measured, not read from the flags: the flags say
whether the cores have bf16 dot products (``NATIVE_BF16_FLAGS``; without them bf16 is emulated, tens of
times slower), not whether torch's bf16 kernels beat its fp32 ones there. Both ways were measured on
two cores with AVX512-BF16 (docs/benchmarks.md §8): an AMD EPYC ran the MLP's matmul 2.1x faster in
bf16 than in fp32; an Intel Xeon without AMX ran it at 164 GFLOP/s in bf16 against 297 in fp32
(MKL's fp32 GEMM), and the whole iteration took 11.2 s in bf16 against TRL's 6.5 s in fp32.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from typing import Optional

import psutil
import torch

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""/proc/cpuinfo flags of x86 cores with bf16 matrix instructions (AVX512-BF16's dot products, AMX's tiles)."""

BF16_PAYS_AT = 1.3
"""How many times fp32's rate bf16's must reach on a CPU for ``cpu_bf16_pays``: a margin over 1 for
what the rate leaves out (casts, bf16 elementwise kernels, DeepSpeed's fp32 master weights), and wide
enough that two measurements on one machine do not land on either side (the machines measured sit at
0.55 and 2.1)."""

CPU_BF16_ENV = "RLHF_CPU_BF16"
"""'1' / '0': whether bf16 pays on this CPU, said by the user or by the first measurement in this
process tree (``cpu_bf16_pays``)."""

GPU_PEAKS = {"GB200": 2.5e15, "B200": 2.25e15, "MI300X": 1.336e15, "H200": 989e12, "H100": 989e12, "H800": 989e12,
             "H20": 148e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12, "L40": 181e12, "A40": 150e12,
             "L20": 119.5e12, "L4": 121e12, "A10": 125e12}
"""Dense bf16/fp16 FLOP/s of GPUs by a part of their device name (the longest matching name wins)."""


@functools.lru_cache(maxsize=1)
def cpu_description() -> tuple[str, tuple[str, ...]]:
    """(model name, flags) of this machine's CPU from /proc/cpuinfo; ('unknown', ()) where it cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown", ()
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    return fields.get("model name", "unknown"), tuple(fields.get("flags", "").split())


def cpu_native_bf16() -> bool:
    """Whether this CPU has bf16 matrix instructions (``NATIVE_BF16_FLAGS``)."""
    return any(flag in cpu_description()[1] for flag in NATIVE_BF16_FLAGS)


def cpu_bf16_pays() -> bool:
    """Whether bf16 matmuls run at least ``BF16_PAYS_AT`` x as fast as fp32 ones on this CPU: never
    without native bf16; else measured (``device_rate``, ~1 s) once per process tree. The answer goes
    into ``CPU_BF16_ENV`` so that the processes this one starts (stage and rank processes) take the
    same dtype without measuring again: ranks that measured on their own could land on either side and
    train in different dtypes. A user's ``RLHF_CPU_BF16=0|1`` is taken as it is."""
    said = os.environ.get(CPU_BF16_ENV)
    if said in ("0", "1"):
        return said == "1"
    pays = False
    if cpu_native_bf16():
        bf16, fp32 = _rates_judged()
        pays = bf16 >= BF16_PAYS_AT * fp32
    os.environ[CPU_BF16_ENV] = "1" if pays else "0"
    return pays


@functools.lru_cache(maxsize=1)
def _rates_judged() -> tuple[float, float]:
    """(bf16, fp32) matmul rates behind this process's ``cpu_bf16_pays``, measured once."""
    return device_rate("cpu", "bf16"), device_rate("cpu", "fp32")


def bf16_judgment() -> str:
    """Why ``cpu_bf16_pays`` answered as it did, in a few words for the line a run prints."""
    if _rates_judged.cache_info().currsize:
        bf16, fp32 = _rates_judged()
        return f"bf16 matmuls at {bf16 / 1e9:.0f} GFLOP/s against {fp32 / 1e9:.0f} in fp32, measured"
    if not cpu_native_bf16():
        return "no bf16 matrix instructions"
    if CPU_BF16_ENV in os.environ:
        return f"{CPU_BF16_ENV}={os.environ[CPU_BF16_ENV]} (set by the user or the process that started this one)"
    return "not judged yet"


@functools.lru_cache(maxsize=None)
def device_rate(device: str, dtype: str) -> float:
    """FLOP/s of a matmul on ``device`` ('cpu' | 'cuda') in ``dtype`` ('fp32' | 'bf16' | 'fp16'): a GPU's
    listed peak in bf16/fp16, else measured once per process (module docstring)."""
    if device.startswith("cuda") and dtype != "fp32":
        peak = _gpu_peak(torch.cuda.get_device_name())
        if peak is not None:
            return peak
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    if device != "cpu":
        return _measure(torch.device(device), torch_dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(torch.device("cpu"), torch_dtype) * physical_cores()
    finally:
        torch.set_num_threads(before)


def physical_cores() -> int:
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def _gpu_peak(name: str) -> Optional[float]:
    matches = [key for key in GPU_PEAKS if key in name]
    return GPU_PEAKS[max(matches, key=len)] if matches else None


def _measure(device: torch.device, dtype: torch.dtype) -> float:
    # a GPU by wall time; a CPU on one thread by that thread's CPU time (module docstring)
    clock = time.thread_time if device.type == "cpu" else time.perf_counter

    # a private generator: the global RNG is the training's (its state goes into checkpoints, and a
    # measurement made (and cached) in one process but not another must not shift it)
    generator = torch.Generator(device=device).manual_seed(0)

    def rate(m: int, k: int, n: int, repeats: int) -> float:
        a = torch.randn(m, k, device=device, generator=generator).to(dtype)
        b = torch.randn(k, n, device=device, generator=generator).to(dtype)
        best = float("inf")
        for _ in range(repeats):
            _sync(device)
            started = clock()
            a @ b
            _sync(device)
            best = min(best, clock() - started)
        return 2.0 * m * k * n / max(best, 1e-9)

    small = rate(128, 896, 1024, 2)  # 0.24 GFLOP: enough where the dtype is slow (bf16 without bf16 units)
    if 2.0 * 128 * 896 * 1024 / small > 0.02:
        return small
    return rate(944, 896, 4864, 5 if device.type == "cpu" else 20)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
