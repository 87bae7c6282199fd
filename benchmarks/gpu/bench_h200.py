"""Rollout and update throughput of a ~0.5B-parameter Qwen2-shaped model (Qwen2.5-0.5B's shape, random
weights) on one GPU: HF batched ``generate`` tokens/s, then our PPO update (``one_update_trainer``'s update, the body of
``rlhf stage update``: critic and actor through DeepSpeed, bf16) tokens/s and model FLOPs utilisation.

    python benchmarks/gpu/bench_h200.py                 # on the GPU machine (benchmarks/gpu/bench_h200.sh)
    python benchmarks/gpu/bench_h200.py --dry-run       # the same steps on the CPU at a small shape (CI runs it)

Steps: (1) the tiny model's tokenizer (rlhf_core.models.tiny) + a Qwen2Config of the requested shape with
random bf16 weights, saved as an HF directory; (2) rollout: ``--batch`` random prompts of ``--prompt-len``
tokens, sampled to exactly ``--new-tokens`` new tokens (min = max), one warm-up call, then one timed call;
(3) scoring: old log-probs of those sequences under the same model (rlhf_core.scoring.logprobs) into an
advantages table (Gaussian advantages/returns: throughput does not depend on their values); (4) one PPO
update with ``--epochs`` epochs and mini-batches of ``--mini-batch`` sequences, micro-batches packed to
``--token-budget`` tokens. ``--mini-batch`` defaults to 64, cut to ``--batch`` when that is smaller (said in
one line on stderr). A bad argument (a count below 1, a ``--mini-batch`` above ``--batch``, a sequence longer
than ``--token-budget``, ``--device cuda`` without CUDA) is refused in one line, exit status 2, before
anything is built.

MFU = 6 × params × tokens/s / peak: training costs ~6 FLOPs per parameter per token (forward 2, backward
4; attention's own FLOPs left out, as is usual). Update: actor and critic each train on every token, so
6 × (actor params + critic params) × perf/tokens_per_s, the critic counted without the embedding (it has no
LM-head matmul; the actor's tied embedding is its LM head). Peak: H200 dense bf16 989 TFLOP/s (``--peak-tflops``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from arguments import (device_name, note, output_file, positive_float, positive_int, require_device,  # noqa: E402
                       zero_stage)

QWEN25_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  intermediate_size=4864, vocab_size=151936)
SMALL = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=352, vocab_size=4096)
MAX_POSITIONS = 4096
"""The model's max_position_embeddings (build_model): a prompt and its response must fit in it."""
DEFAULT_MINI_BATCH = 64


def build_model(out: Path, shape: dict, device: str) -> int:
    """Tokenizer from the tiny builder, weights random at ``shape``; returns the parameter count."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rlhf_core.models.tiny import build_tiny_model

    build_tiny_model(out)  # tokenizer files (ids < 512 are text; larger ids are valid model tokens)
    tiny = json.loads((out / "config.json").read_text())
    config = Qwen2Config(**shape, max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1e6,
                         eos_token_id=tiny["eos_token_id"], pad_token_id=tiny["pad_token_id"], bos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    for f in out.glob("model*.safetensors"):
        f.unlink()
    model.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def rollout(model_dir: Path, args, device: str) -> tuple[list[list[int]], list[list[int]], dict]:
    """Timed batched sampling; returns (prompts, responses, numbers)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa").to(device)
    model.eval()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(600, model.config.vocab_size, (args.batch, args.prompt_len), generator=g).to(device)
    mask = torch.ones_like(prompts)

    def sample(new: int):
        out = model.generate(input_ids=prompts, attention_mask=mask, do_sample=True, max_new_tokens=new,
                             min_new_tokens=new, pad_token_id=model.config.pad_token_id, use_cache=True)
        if device == "cuda":
            torch.cuda.synchronize()
        return out

    sample(min(8, args.new_tokens))  # warm-up: kernels, allocator
    started = time.perf_counter()
    out = sample(args.new_tokens)
    seconds = time.perf_counter() - started
    responses = out[:, args.prompt_len:].tolist()
    new_tokens = sum(len(r) for r in responses)
    numbers = {"rollout_seconds": seconds, "rollout_new_tokens": new_tokens, "rollout_tokens_per_s": new_tokens / seconds,
               "rollout_peak_gpu_gb": torch.cuda.max_memory_allocated() / 1024 ** 3 if device == "cuda" else 0.0}
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return prompts.tolist(), responses, numbers


def advantages_table(model_dir: Path, prompts, responses, device: str, budget: int):
    """ADVANTAGES rows for (prompt, response) pairs (``training.synthetic``, the update tests' table: every
    column of the schema, so it cannot fall behind it); old = ref log-probs scored by the model on ``device``."""
    from rlhf_core.training.synthetic import synthetic_advantages

    return synthetic_advantages(model_dir, pairs=list(zip(prompts, responses)), device=device,
                                dtype="bf16" if device == "cuda" else "fp32", budget=budget)


def update(model_dir: Path, home: Path, table, args, device: str) -> dict:
    from rlhf_core.config import load_config
    from rlhf_core.data.schemas import ADVANTAGES
    from rlhf_core.io.atomic import atomic_write_parquet
    from rlhf_core.run.layout import RunDir
    from rlhf_core.stages.init_critic import run_init_critic
    from rlhf_core.training.run_trainer import one_update_trainer

    run = RunDir(home / "run")
    atomic_write_parquet(run.advantages(1), table, ADVANTAGES)
    cfg = load_config(str(REPO / "configs/demo.yaml"), [
        f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.model.warm_start.enable=false",
        f"trainer.device={device}", f"data.train_batch_size={args.batch}", f"data.max_prompt_length={args.prompt_len}",
        f"data.max_response_length={args.new_tokens}", f"actor_rollout_ref.actor.ppo_mini_batch_size={args.mini_batch}",
        f"actor_rollout_ref.actor.ppo_epochs={args.epochs}",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={args.token_budget}",
        f"actor_rollout_ref.actor.deepspeed_config.zero_stage={args.zero}", f"critic.deepspeed_config.zero_stage={args.zero}"])
    run_init_critic(cfg, run)  # the setup stage `rlhf run` runs first: the update starts from models/critic_init
    with one_update_trainer(cfg, run, 1) as trainer:
        return trainer.update(cfg, 1, progress=False)


def parse_args(argv=None) -> argparse.Namespace:
    """The arguments, checked before anything is built: a bad value is one line and exit status 2."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", type=device_name, default="cuda")
    parser.add_argument("--small", action="store_true", help="a small shape, for a dry run without a GPU")
    parser.add_argument("--dry-run", action="store_true",
                        help="every step on the CPU at the small shape and a handful of tokens (what CI runs)")
    parser.add_argument("--batch", type=positive_int, default=256)
    parser.add_argument("--prompt-len", type=positive_int, default=128)
    parser.add_argument("--new-tokens", type=positive_int, default=256)
    parser.add_argument("--mini-batch", type=positive_int,
                        help=f"sequences per optimizer step (default: {DEFAULT_MINI_BATCH}, or --batch if smaller)")
    parser.add_argument("--epochs", type=positive_int, default=2)
    parser.add_argument("--token-budget", type=positive_int, default=16384)
    parser.add_argument("--zero", type=zero_stage, default=1)
    parser.add_argument("--peak-tflops", type=positive_float, default=989.0, help="dense bf16 peak of the GPU")
    parser.add_argument("--out", type=output_file, help="also write the numbers here as JSON")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.small, args.device = True, "cpu"
        args.batch, args.prompt_len, args.new_tokens, args.mini_batch, args.epochs, args.token_budget = 4, 8, 8, 4, 1, 256
    if args.mini_batch is None:
        args.mini_batch = derived_mini_batch(args.batch)
    elif args.mini_batch > args.batch:
        parser.error(f"--mini-batch {args.mini_batch} must be between 1 and --batch {args.batch} (sequences per "
                     "optimizer step out of the batch)")
    length = args.prompt_len + args.new_tokens  # every sequence is sampled to exactly this length
    if length > MAX_POSITIONS:
        parser.error(f"--prompt-len {args.prompt_len} + --new-tokens {args.new_tokens} = {length} tokens is more "
                     f"than the model's {MAX_POSITIONS} positions; shorten one of them")
    if length > args.token_budget:
        parser.error(f"--token-budget {args.token_budget} cannot hold one sequence of --prompt-len {args.prompt_len} "
                     f"+ --new-tokens {args.new_tokens} tokens; give --token-budget {length} or more")
    require_device(parser, "--device", args.device, " (or --dry-run)")
    return args


def derived_mini_batch(batch: int) -> int:
    """The mini-batch when none is given: the default, cut to the batch (the config refuses a mini-batch
    larger than data.train_batch_size; it asks for no divisibility), said in one line when cut."""
    if batch >= DEFAULT_MINI_BATCH:
        return DEFAULT_MINI_BATCH
    note("bench_h200", f"--mini-batch {batch}: the default {DEFAULT_MINI_BATCH} is more than --batch {batch}")
    return batch


def main() -> None:
    args = parse_args()
    os.environ.setdefault("RLHF_HOME", tempfile.mkdtemp(prefix="rlhf-bench-gpu-"))
    home = Path(os.environ["RLHF_HOME"])
    model_dir = home / "qwen2-shaped"
    t0 = time.perf_counter()
    params = build_model(model_dir, SMALL if args.small else QWEN25_05B, args.device)  # tied: embedding = LM head
    numbers: dict = {"params": params, "build_seconds": time.perf_counter() - t0}
    prompts, responses, rolled = rollout(model_dir, args, args.device)
    numbers.update(rolled)
    t0 = time.perf_counter()
    table = advantages_table(model_dir, prompts, responses, args.device, args.token_budget)
    numbers["scoring_seconds"] = time.perf_counter() - t0
    m = update(model_dir, home, table, args, args.device)
    shape = SMALL if args.small else QWEN25_05B
    # the critic has no LM head matmul (the embedding is a lookup): backbone minus embedding + value head
    critic_params = params - shape["vocab_size"] * shape["hidden_size"] + shape["hidden_size"] + 1
    flops = 6 * (params + critic_params) * m["perf/tokens_per_s"]
    numbers.update({k: m[k] for k in ("perf/tokens_per_s", "perf/actor_tokens_per_s", "perf/critic_tokens_per_s",
                                      "perf/update_seconds", "perf/setup_seconds", "perf/checkpoint_seconds")},
                   update_tflops=flops / 1e12, mfu=flops / (args.peak_tflops * 1e12),
                   actor_mfu=6 * params * m["perf/actor_tokens_per_s"] / (args.peak_tflops * 1e12))
    print(json.dumps(numbers, indent=1))
    print(f"\n{params / 1e6:.0f}M params; rollout {numbers['rollout_tokens_per_s']:.0f} new tokens/s "
          f"({args.batch} x {args.new_tokens} in {numbers['rollout_seconds']:.1f} s); update {m['perf/tokens_per_s']:.0f} tokens/s "
          f"(actor {m['perf/actor_tokens_per_s']:.0f}, critic {m['perf/critic_tokens_per_s']:.0f}), "
          f"{numbers['update_tflops']:.1f} TFLOP/s, MFU {numbers['mfu']:.1%} of {args.peak_tflops:.0f} TFLOP/s")
    if args.out:
        args.out.write_text(json.dumps(numbers, indent=1))


if __name__ == "__main__":
    main()
