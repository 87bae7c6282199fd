"""A resident vLLM engine against a cold start, at Qwen2.5-0.5B's shape (random weights) on one GPU.

Without resident models the rollout builds a new ``vllm.LLM`` for every rollout and every validation;
the resident engine (``VLLMEngine(..., resident=True)``) is built once and, every iteration, sleeps
through the update and takes the updated weights in memory. This prints, side by side: the cold
start (building the engine), sleep, load_weights (which checks every name and shape, wakes the
weights, writes them through vLLM's reload, then wakes the KV cache), and a plain sleep → wake_up,
the GPU memory in use before and after each sleep, and the ratio cold start / (sleep + load_weights). Each round also checks the engine: greedy tokens after sleep → wake_up equal
those before; after loading perturbed weights they differ; loading the originals back restores them.

    python benchmarks/gpu/bench_vllm_resident.py                  # on a GPU machine with vllm installed
    python benchmarks/gpu/bench_vllm_resident.py --layers 4 --rounds 2 --out /tmp/vllm_resident.json
    .venv-vllm/bin/python benchmarks/gpu/bench_vllm_resident.py --dry-run   # vLLM's CPU build, small shape (make test-vllm)

The model: bench_h200.build_model (the tiny tokenizer + a Qwen2Config of Qwen2.5-0.5B's layer shape,
bf16, seed 0), written locally, no hub. Its vocabulary is the real 151,936 tokens while the tokenizer
knows 512, so the checks generate with ``detokenize=False`` straight on ``engine.llm``. The "updated
actor" is the checkpoint's own tensors on the GPU (bf16, as a trainer holds them) plus Gaussian noise
(``--noise`` × each tensor's standard deviation).
Exits with status 2 and the reason when this machine has no CUDA GPU or no vllm, or when an argument is
bad (a count below 1, a ``--gpu-memory-utilization`` outside (0, 1], a ``--max-model-len`` that cannot hold
the 32-token prompts and ``--new-tokens``), before anything is built. The dry run takes
the same steps with vLLM's CPU build at a small shape in fp32 (1 layer, 2 heads of 64, vocabulary
4096): there sleep frees nothing and the memory columns read 0, and the checks still hold.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO / "benchmarks"))

from arguments import fraction, output_file, positive_float, positive_int  # noqa: E402

GiB = 1024 ** 3
PROMPT_TOKENS = 32
"""Tokens of each random prompt the checks generate from."""


def greedy_tokens(engine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy token ids from ``engine.llm`` without detokenising (the model's ids exceed the tokenizer's)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
    outputs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


DRY_RUN_SHAPE = dict(hidden_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                     intermediate_size=352, vocab_size=4096)
"""The dry run's model: head size 64, which vLLM's CPU attention takes."""


def actor_weights(model_dir: Path, device: str):
    """The checkpoint's tensors on ``device`` under their Hugging Face names (what a trainer would pass)."""
    from safetensors.torch import load_file

    weights = {}
    for f in sorted(model_dir.glob("model*.safetensors")):
        weights.update(load_file(str(f), device=device))
    return weights


def in_use() -> int:
    """Bytes in use on the GPU by every process (vLLM's sleep pool is outside torch's allocator); 0 on the CPU."""
    import torch

    if not torch.cuda.is_available():
        return 0
    free, total = torch.cuda.mem_get_info()
    return total - free


def timed(fn) -> float:
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    started = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=positive_int, default=24, help="decoder layers (Qwen2.5-0.5B has 24)")
    parser.add_argument("--rounds", type=positive_int, default=3, help="sleep → load_weights → generate rounds")
    parser.add_argument("--gpu-memory-utilization", type=fraction, default=0.5)
    parser.add_argument("--max-model-len", type=positive_int, default=2048)
    parser.add_argument("--prompts", type=positive_int, default=8)
    parser.add_argument("--new-tokens", type=positive_int, default=16)
    parser.add_argument("--out", type=output_file, help="also write the numbers here as JSON")
    parser.add_argument("--noise", type=positive_float, default=0.5,
                        help="the updated actor: weights + noise × each tensor's std (> 0: the check needs a change)")
    parser.add_argument("--dry-run", action="store_true", help="vLLM's CPU build at a small shape, fp32, one round")
    args = parser.parse_args()
    if args.dry_run:  # one random layer with tied embeddings repeats its input token unless the noise swamps it
        args.rounds, args.prompts, args.new_tokens, args.max_model_len, args.noise = 1, 4, 16, 256, 4.0
    if args.max_model_len < PROMPT_TOKENS + args.new_tokens:
        parser.error(f"--max-model-len {args.max_model_len} cannot hold a {PROMPT_TOKENS}-token prompt and "
                     f"--new-tokens {args.new_tokens}; give --max-model-len {PROMPT_TOKENS + args.new_tokens} or more")

    from rlhf_core.rollout.vllm_engine import VLLMEngine, vllm_unavailable_reason

    reason = vllm_unavailable_reason()
    if reason:
        print(f"bench_vllm_resident: cannot run here: {reason}", file=sys.stderr)
        sys.exit(2)
    import torch

    if not args.dry_run and not torch.cuda.is_available():  # a vLLM CPU build passes the check above
        print("bench_vllm_resident: cannot run here: no CUDA GPU is visible (on the CPU: --dry-run)", file=sys.stderr)
        sys.exit(2)
    import vllm

    from bench_h200 import QWEN25_05B, build_model

    device = "cpu" if args.dry_run else "cuda"
    model_dir = Path(tempfile.mkdtemp(prefix="rlhf-bench-vllm-")) / "qwen2.5-0.5b-shaped"
    shape = DRY_RUN_SHAPE if args.dry_run else dict(QWEN25_05B, num_hidden_layers=args.layers)
    params = build_model(model_dir, shape, "cpu")
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 512, (args.prompts, PROMPT_TOKENS), generator=g).tolist()

    before_engine = in_use()
    started = time.perf_counter()
    engine = VLLMEngine(model_dir, gpu_memory_utilization=args.gpu_memory_utilization,
                        max_model_len=args.max_model_len, dtype="fp32" if args.dry_run else "bf16", seed=0, resident=True)
    cold = time.perf_counter() - started
    numbers: dict = {"vllm": vllm.__version__, "params": params, "layers": shape["num_hidden_layers"],
                     "gpu": torch.cuda.get_device_name() if device == "cuda" else "none (dry run)",
                     "cold_start_seconds": cold, "engine_gpu_gib": (in_use() - before_engine) / GiB, "rounds": []}
    base = greedy_tokens(engine, prompts, args.new_tokens)
    original = actor_weights(model_dir, device)
    noise = torch.Generator(device=device).manual_seed(1)
    perturbed = {n: (t.float() + args.noise * t.float().std() * torch.randn(t.shape, generator=noise, device=device))
                 .to(t.dtype) for n, t in original.items()}

    for r in range(args.rounds):
        row: dict = {"in_use_awake_gib": in_use() / GiB}
        row["sleep_seconds"] = timed(engine.sleep)
        row["in_use_asleep_gib"] = in_use() / GiB
        row["wake_up_seconds"] = timed(engine.wake_up)  # same weights back (the rollback-free path)
        same = greedy_tokens(engine, prompts, args.new_tokens) == base
        engine.sleep()
        row["load_weights_seconds"] = timed(lambda: engine.load_weights(perturbed.items()))
        changed = greedy_tokens(engine, prompts, args.new_tokens) != base
        row["resleep_seconds"] = timed(engine.sleep)
        row["load_original_seconds"] = timed(lambda: engine.load_weights(original.items()))
        restored = greedy_tokens(engine, prompts, args.new_tokens) == base
        row.update(freed_gib=row["in_use_awake_gib"] - row["in_use_asleep_gib"], wake_same_tokens=same,
                   perturbed_tokens_differ=changed, original_tokens_restored=restored)
        numbers["rounds"].append(row)
        print(f"round {r}: in use {row['in_use_awake_gib']:.2f} GiB awake -> {row['in_use_asleep_gib']:.2f} GiB "
              f"asleep (freed {row['freed_gib']:.2f}); sleep {row['sleep_seconds']:.2f} s, wake_up "
              f"{row['wake_up_seconds']:.2f} s, load_weights {row['load_weights_seconds']:.2f} s; checks: "
              f"wake same {same}, perturbed differ {changed}, restored {restored}", flush=True)

    engine.close()
    last = numbers["rounds"][-1]
    resident = last["sleep_seconds"] + last["load_weights_seconds"]
    numbers["cold_over_resident"] = cold / resident
    print(json.dumps(numbers, indent=1))
    print(f"\n{params / 1e6:.0f}M params, vLLM {vllm.__version__}: cold start {cold:.1f} s vs sleep + load_weights "
          f"{resident:.2f} s ({numbers['cold_over_resident']:.0f}x); sleep frees {last['freed_gib']:.1f} of "
          f"{last['in_use_awake_gib']:.1f} GiB in use")
    if args.out:
        args.out.write_text(json.dumps(numbers, indent=1))
    ok = all(r["wake_same_tokens"] and r["perturbed_tokens_differ"] and r["original_tokens_restored"]
             for r in numbers["rounds"])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
