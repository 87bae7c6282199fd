"""The vLLM rollout engine against Hugging Face generate on CPU, side by side, at Qwen2.5-0.5B's layer
shape (benchmarks.shapes: 8 layers by default, ~120 M parameters, random fp32 weights, the tiny
tokenizer): engine start, generation tokens/s on the same prompts, and for vLLM the in-place weight
sync of a resident engine (names and shapes checked, weights written, a probe's log-probs compared
with the trainer module's) against starting a new engine on the new checkpoint.

    .venv-vllm/bin/python benchmarks/bench_vllm.py [--layers 8] [--prompts 64] [--new-tokens 32] [--syncs 3]
    .venv-vllm/bin/python benchmarks/bench_vllm.py --model data/models/smollm2-135m-instruct   (a real model)

``--model DIR`` measures a real model instead (`make smollm2` imports SmolLM2-135M-Instruct): its own
tokenizer and chat template, its own weights, so responses stop at its end-of-turn token as in a run.

Run it in the environment `make test-vllm` builds (vLLM's CPU build); without vLLM it exits with
status 2 and the reason. Prompts are the embedded arithmetic problems in the chat template; each
engine samples every prompt once at temperature 1 (seeded), max --new-tokens tokens, as the
rollout calls it: HF generate over the pack stage's generation batches (8,192-token budget), vLLM in
one call. The random-weight model rarely samples EOS, so nearly every response runs to the limit and
both engines generate about the same number of tokens. Wall-clock on a shared machine: other load
shows up in the numbers; the ratios are the point.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from arguments import output_file, positive_int  # noqa: E402

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    rows = [json.loads(line) for line in (REPO / "data/arith/train.jsonl").read_text().splitlines()[:n]]
    texts = tokenizer.apply_chat_template([[{"role": "user", "content": r["question"]}] for r in rows],
                                          tokenize=False, add_generation_prompt=True)
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def hf_side(model_dir: Path, prompts: list[list[int]], sampling, budget: int) -> dict:
    from rlhf_core.data.packing import plan_generation_batches
    from rlhf_core.rollout.hf import HFEngine

    started = time.perf_counter()
    engine = HFEngine(model_dir, device="cpu")
    start = time.perf_counter() - started
    plan = plan_generation_batches([len(p) for p in prompts], sampling.max_new_tokens, sampling.n, budget)
    tic, tokens = time.perf_counter(), 0
    for batch in plan:
        tokens += sum(len(s.token_ids) for s in engine.generate([prompts[i] for i in batch], sampling))
    seconds = time.perf_counter() - tic
    engine.close()
    return {"start_s": start, "generate_s": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "batches": len(plan)}


def vllm_side(model_dir: Path, moved_dir: Path, prompts: list[list[int]], sampling, syncs: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf_core.rollout.vllm_engine import VLLMEngine

    tokens_in_flight = len(prompts) * (max(map(len, prompts)) + sampling.max_new_tokens)
    started = time.perf_counter()
    engine = VLLMEngine(model_dir, dtype="fp32", max_model_len=1024, resident=True, rollout_tokens=tokens_in_flight)
    start = time.perf_counter() - started
    engine.generate(prompts[:2], sampling)  # first call's one-off costs (the rollout's first call pays them too)
    tic = time.perf_counter()
    tokens = sum(len(s.token_ids) for s in engine.generate(prompts, sampling))
    seconds = time.perf_counter() - tic
    trainer = AutoModelForCausalLM.from_pretrained(moved_dir, dtype=torch.float32)  # the "updated actor"
    rounds = []
    for _ in range(syncs):
        engine.sleep()
        tic = time.perf_counter()
        metrics = engine.sync_from(trainer)
        rounds.append({"sync_s": time.perf_counter() - tic, **metrics})
    engine.close()
    restart_tic = time.perf_counter()  # what the non-resident design pays instead: an engine on the new checkpoint
    VLLMEngine(moved_dir, dtype="fp32", max_model_len=1024, rollout_tokens=tokens_in_flight).close()
    restart = time.perf_counter() - restart_tic
    best = min(rounds, key=lambda r: r["sync_s"])
    return {"start_s": start, "generate_s": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "sync_s": best["sync_s"], "sync_load_s": best["perf/rollout_weight_sync_seconds"],
            "sync_logprob_max_diff": max(r["rollout/weight_sync_logprob_max_diff"] for r in rounds),
            "restart_s": restart, "syncs": rounds}


def moved_copy(model_dir: Path, out: Path) -> Path:
    """The checkpoint with every weight moved a little (what an update hands the engine)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (out / "config.json").is_file():
        return out
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * p.float().std() * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="a model directory to measure instead of the random-weight shape")
    parser.add_argument("--layers", type=positive_int, default=8)
    parser.add_argument("--prompts", type=positive_int, default=64)
    parser.add_argument("--new-tokens", type=positive_int, default=32)
    parser.add_argument("--syncs", type=positive_int, default=3, help="weight syncs timed (best reported)")
    parser.add_argument("--budget", type=positive_int, default=8192, help="hf: generation batch token budget")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=output_file, help="also write the numbers here as JSON")
    args = parser.parse_args()
    if args.model is not None and not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there (for SmolLM2: `make smollm2`)")

    from rlhf_core.rollout.vllm_engine import vllm_unavailable_reason

    reason = vllm_unavailable_reason()
    if reason:
        print(f"bench_vllm: cannot run here: {reason}", file=sys.stderr)
        sys.exit(2)
    os.environ.setdefault("TQDM_DISABLE", "1")
    from transformers import AutoTokenizer

    from benchmarks.shapes import build_shape_model
    from rlhf_core.paths import state_dir
    from rlhf_core.rollout.base import SamplingParams

    root = state_dir() / "models" / "shapes"
    if args.model is None:
        model_dir = build_shape_model(root, "qwen2.5-0.5b", layers=args.layers, seed=args.seed)
        what = f"Qwen2.5-0.5B shape cut to {args.layers} layers"
    else:
        model_dir, what = args.model.resolve(), f"{args.model.name} (its own weights and tokenizer)"
    moved = moved_copy(model_dir, root / f"{model_dir.name}-moved")
    prompts = chat_prompts(AutoTokenizer.from_pretrained(model_dir), args.prompts)
    sampling = SamplingParams(max_new_tokens=args.new_tokens, seed=args.seed)
    hf = hf_side(model_dir, prompts, sampling, args.budget)
    vl = vllm_side(model_dir, moved, prompts, sampling, args.syncs)
    numbers = {"layers": args.layers, "prompts": args.prompts, "new_tokens": args.new_tokens, "hf": hf, "vllm": vl}
    print(f"{args.prompts} prompts x at most {args.new_tokens} new tokens, {what}, fp32, CPU ({os.cpu_count()} cores)")
    print(f"{'':24}{'hf generate':>14}{'vllm':>14}{'ratio':>10}")
    print(f"{'engine start (s)':24}{hf['start_s']:14.2f}{vl['start_s']:14.2f}{vl['start_s'] / hf['start_s']:10.1f}")
    print(f"{'generate (s)':24}{hf['generate_s']:14.2f}{vl['generate_s']:14.2f}"
          f"{hf['generate_s'] / vl['generate_s']:10.2f}x faster")
    print(f"{'tokens/s':24}{hf['tokens_per_s']:14.0f}{vl['tokens_per_s']:14.0f}")
    print(f"vllm weight sync in place {vl['sync_s']:.2f} s (load {vl['sync_load_s']:.2f} s + probe check; max "
          f"|log-prob diff| {vl['sync_logprob_max_diff']:.1e}) vs a new engine on the checkpoint {vl['restart_s']:.2f} s "
          f"({vl['restart_s'] / vl['sync_s']:.0f}x)")
    if args.out:
        args.out.write_text(json.dumps(numbers, indent=1))


if __name__ == "__main__":
    main()
