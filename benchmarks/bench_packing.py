"""Packing efficiency on GSM8K: token-budget packing vs pad-to-longest batches.

    python benchmarks/bench_packing.py [--data data/gsm8k/train.jsonl] [--seed 0]

Prompt lengths come from the real preprocess core (chat template + the tiny model's tokenizer,
configs/gsm8k.yaml with every row kept for training); response lengths are the GSM8K reference
answers' token counts (+1 for EOS, at most max_response_length). Efficiency = real tokens / token slots:

- generation: prompts of one iteration (256) cut into batches by ``plan_generation_batches`` vs the
  same number of random batches. "prompt" = left-padded prompt slots only; "full" = prompt + the
  answer, each row running until the batch's longest answer ends (how ``generate`` pads).
- training: sequences (prompt + answer) in mini-batches of 256, packed by BFD under a token budget.
  "fill" = real / (bins × budget) (each bin a fixed-width packed row: the conservative number);
  "padded" = the same bins laid out one sequence per row, padded to the bin's longest (dynamic batch
  size without packing); the baseline is random micro-batches with the same number of sequences as
  our bins hold on average, padded to their longest.
Deterministic for a given --seed; timings are wall-clock on this machine.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DATA = next((p for p in (REPO / "data" / "gsm8k" / "train.jsonl",
                                  REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl") if p.is_file()),
                    REPO / "data" / "gsm8k" / "train.jsonl")
ITERATION_PROMPTS = 256  # configs/gsm8k.yaml data.train_batch_size
MAX_RESPONSE = 256  # configs/gsm8k.yaml data.max_response_length


def load_lengths(data: Path) -> tuple[list[int], list[int]]:
    """(prompt lengths, response lengths) of the accepted GSM8K train prompts; a response is the
    reference answer + EOS, cut at max_response_length as generation would cut it."""
    from rlhf_core.config import load_config
    from rlhf_core.data.preprocess import load_tokenizer, preprocess_files
    from rlhf_core.data.schemas import decode_extra_info

    cfg = load_config(REPO / "configs" / "gsm8k.yaml", [f"data.train_files=[{data}]", "data.val_fraction=0.0"])
    tokenizer = load_tokenizer(cfg.actor_rollout_ref.model)
    result = preprocess_files([data], [], cfg.data, tokenizer, progress=False)
    prompts = result.train.column("prompt_length").to_pylist()
    answers = [decode_extra_info(text)["answer"] for text in result.train.column("extra_info").to_pylist()]
    encoded = tokenizer(answers, add_special_tokens=False)["input_ids"]
    return prompts, [min(len(ids) + 1, MAX_RESPONSE) for ids in encoded]


def chunks(order: list[int], size: int) -> list[list[int]]:
    return [order[s:s + size] for s in range(0, len(order), size)]


def generation_table(prompts: list[int], answers: list[int], seed: int) -> None:
    from rlhf_core.data.packing import padded_batches_efficiency, plan_generation_batches

    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    slots = chunks(order, ITERATION_PROMPTS)
    full = [p + a for p, a in zip(prompts, answers)]

    def full_eff(batches):  # rows run until the batch's longest answer; prompts left-padded
        slots_used = sum(len(b) * (max(prompts[i] for i in b) + max(answers[i] for i in b)) for b in batches)
        return sum(full[i] for b in batches for i in b) / slots_used

    print(f"\nGeneration batches: {len(slots)} iterations of up to {ITERATION_PROMPTS} prompts, "
          f"max_response_length={MAX_RESPONSE}")
    print(f"{'budget':>7} {'n':>2} {'batches':>8} {'prompts/b':>9} | "
          f"{'prompt eff: ours':>16} {'random':>7} {'ratio':>6}"
          f" | {'full eff: ours':>14} {'random':>7} {'ratio':>6}")
    rng = random.Random(seed + 1)
    for n in (1, 4):
        for budget in (4096, 8192, 16384, 32768):
            ours, baseline = [], []
            for slot in slots:
                local = plan_generation_batches([prompts[i] for i in slot], MAX_RESPONSE, n, budget)
                ours += [[slot[k] for k in b] for b in local]
                size = -(-len(slot) // len(local))
                baseline += chunks(rng.sample(slot, len(slot)), size)
            pe, pb = padded_batches_efficiency(prompts, ours), padded_batches_efficiency(prompts, baseline)
            fe, fb = full_eff(ours), full_eff(baseline)
            print(f"{budget:>7} {n:>2} {len(ours):>8} {len(order) / len(ours):>9.1f} | {pe:>16.1%} {pb:>7.1%} "
                  f"{pe / pb:>6.2f} | {fe:>14.1%} {fb:>7.1%} {fe / fb:>6.2f}")


def training_table(prompts: list[int], answers: list[int], seed: int) -> None:
    from rlhf_core.data.packing import (lower_bound_bins, pack_bfd, pack_ffd, packing_efficiency,
                                        padded_batches_efficiency)

    seqs = [p + a for p, a in zip(prompts, answers)]
    order = list(range(len(seqs)))
    random.Random(seed).shuffle(order)
    minis = chunks(order, ITERATION_PROMPTS)
    print(f"\nTraining micro-batches: {len(seqs)} sequences (prompt + answer) in mini-batches of {ITERATION_PROMPTS}")
    print(f"{'budget':>7} {'bins':>6} {'bound':>6} {'ffd':>6} | {'fill (ours)':>11} {'padded/bin':>10} | "
          f"{'pad-to-longest':>14} {'seqs/batch':>10} | {'ratio fill/pad':>14}")
    rng = random.Random(seed + 2)
    for budget in (1024, 2048, 3072, 4096, 8192):
        bins, ffd, bound, base = [], 0, 0, []
        for mini in minis:
            local = [seqs[i] for i in mini]
            packed = pack_bfd(local, budget)
            bins += [[mini[k] for k in b] for b in packed]
            ffd += len(pack_ffd(local, budget))
            bound += lower_bound_bins(local, budget)
            size = max(1, round(len(mini) / len(packed)))
            base += chunks(rng.sample(mini, len(mini)), size)
        fill, padded = packing_efficiency(seqs, bins, budget), padded_batches_efficiency(seqs, bins)
        pad = padded_batches_efficiency(seqs, base)
        print(f"{budget:>7} {len(bins):>6} {bound:>6} {ffd:>6} | {fill:>11.1%} {padded:>10.1%} | "
              f"{pad:>14.1%} {len(seqs) / len(bins):>10.1f} | {fill / pad:>14.2f}")


def balance_table(prompts: list[int], answers: list[int]) -> None:
    from rlhf_core.data.packing import pack_balanced, pack_bfd

    seqs = [p + a for p, a in zip(prompts, answers)]
    budget = 3072
    print(f"\nData-parallel balance: all {len(seqs)} sequences, budget {budget} "
          f"(one-rank BFD: {len(pack_bfd(seqs, budget))} bins)")
    print(f"{'ranks':>5} {'steps/rank':>10} {'empty bins':>10} {'load min':>9} {'load max':>9} {'spread':>7} "
          f"{'longest seq':>11} {'seconds':>8}")
    for ranks in (1, 2, 4, 8):
        started = time.perf_counter()
        per_rank = pack_balanced(seqs, budget, ranks)
        seconds = time.perf_counter() - started
        loads = [sum(seqs[i] for b in bins for i in b) for bins in per_rank]
        empty = sum(1 for bins in per_rank for b in bins if not b)
        print(f"{ranks:>5} {len(per_rank[0]):>10} {empty:>10} {min(loads):>9} {max(loads):>9} "
              f"{max(loads) - min(loads):>7} {max(seqs):>11} {seconds:>8.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="GSM8K train.jsonl")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not args.data.is_file():
        print(f"GSM8K train split not found at {args.data}: put it at data/gsm8k/train.jsonl (git-ignored), or "
              f"pass --data PATH to a GSM8K-format JSONL", file=sys.stderr)
        return 2
    started = time.perf_counter()
    prompts, answers = load_lengths(args.data)
    print(f"GSM8K train ({args.data}): {len(prompts)} prompts, tiny tokenizer, preprocessed in "
          f"{time.perf_counter() - started:.1f} s")
    for name, values in (("prompt", prompts), ("response", answers)):
        q = statistics.quantiles(values, n=20)
        print(f"  {name} tokens: mean {statistics.mean(values):.0f}, p5 {q[0]:.0f}, "
              f"p50 {statistics.median(values):.0f}, "
              f"p95 {q[-1]:.0f}, max {max(values)}")
    generation_table(prompts, answers, args.seed)
    training_table(prompts, answers, args.seed)
    balance_table(prompts, answers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
