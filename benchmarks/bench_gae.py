"""Benchmark: vectorised GAE (``compute_gae``) against the plain reversed loop over t.

Run from the repository root::

    python benchmarks/bench_gae.py            # (256, 1024) and (1024, 4096), float32
    python benchmarks/bench_gae.py --quick    # (256, 1024) only, fewer repeats

Both implementations see the same inputs (random rewards/values, ~10% trailing padding plus
random holes) within one process. Times are the best of several repeats after a warm-up, so
noise from other processes on a shared machine inflates neither side. Thread count is left
at torch's default.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlhf_core.algos.advantage import compute_gae, compute_gae_reference  # noqa: E402

GAMMA, LAM = 0.99, 0.95
GOAL = 20.0


def make_inputs(batch: int, length: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, length, generator=gen)
    values = torch.randn(batch, length, generator=gen)
    lengths = torch.randint(length // 2, length + 1, (batch, 1), generator=gen)
    mask = (torch.arange(length).unsqueeze(0) < lengths) & (torch.rand(batch, length, generator=gen) > 0.05)
    return rewards, values, mask


def best_ms(fn, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def run(shape, loop_repeats: int, ours_repeats: int):
    rewards, values, mask = make_inputs(*shape)
    kwargs = dict(token_level_rewards=rewards, values=values, response_mask=mask, gamma=GAMMA, lam=LAM)
    ours_adv, ours_ret = compute_gae(**kwargs)
    loop_adv, loop_ret = compute_gae_reference(**kwargs)
    max_diff = max((ours_adv - loop_adv).abs().max().item(), (ours_ret - loop_ret).abs().max().item())
    loop_ms = best_ms(lambda: compute_gae_reference(**kwargs), loop_repeats, warmup=0)
    ours_ms = best_ms(lambda: compute_gae(**kwargs), ours_repeats, warmup=3)
    return loop_ms, ours_ms, max_diff


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only (256, 1024), fewer repeats")
    args = parser.parse_args(argv)
    # (shape, loop repeats, ours repeats): the loop at (1024, 4096) takes seconds per call.
    plan = [((256, 1024), 3 if args.quick else 7, 30 if args.quick else 100)]
    if not args.quick:
        plan.append(((1024, 4096), 2, 10))

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, gamma={GAMMA}, lam={LAM}")
    # Other processes on the cores stall torch's thread pool at every op: report the load so a
    # reader can tell a contended run (where the big shape suffers most) from a quiet one.
    print(f"1-min load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    header = f"{'shape':>12} | {'loop ms':>9} | {'ours ms':>8} | {'speed-up':>8} | {'max |diff|':>10}"
    print(header)
    print("-" * len(header))
    ratios = {}
    for shape, loop_repeats, ours_repeats in plan:
        loop_ms, ours_ms, max_diff = run(shape, loop_repeats, ours_repeats)
        ratios[shape] = loop_ms / ours_ms
        label = f"({shape[0]}, {shape[1]})"
        print(f"{label:>12} | {loop_ms:9.2f} | {ours_ms:8.3f} | {ratios[shape]:7.1f}x | {max_diff:10.2e}")
    verdict = "meets" if ratios[(256, 1024)] >= GOAL else "MISSES"
    print(f"(256, 1024) {verdict} the >= {GOAL:.0f}x goal")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
