"""Whole PPO iterations on a GPU through the real flow, at Qwen2.5-0.5B's layer shape (random weights):
seconds by stage, rollout tokens/s, the rollout's time outside generation (weight sync and wake-up
with the resident vLLM engine), update tokens/s and MFU, and peak GPU memory.

    python benchmarks/gpu/bench_iteration.py [--layers 24] [--iterations 3] [--prompts 256]
                                             [--rollout vllm|hf] [--out FILE]
    python benchmarks/gpu/bench_iteration.py --layers 2 --prompts 8 --max-response 16 --rollout hf   # dry run, CPU

Prompts have mixed, GSM8K-like lengths: each joins 1-4 of the embedded arithmetic problems
(data/arith/train.jsonl), so prompts run ~40-200 tokens in the chat template; responses stop at EOS
or ``--max-response`` (a random-weight model rarely samples EOS, so most run to the cap). The model is
``benchmarks/shapes.build_shape_model`` (Qwen2.5-0.5B's hidden, heads, KV heads and intermediate size,
``--layers`` layers, the tiny tokenizer's 512-token vocabulary: the LM head is cheaper than the real
151,936-token one). The flow is ``flows.pipeline.rlhf_pipeline`` on configs/demo.yaml with the
overrides below, ``--iterations`` + 1 iterations, the first one reported apart (engine start-up).

MFU = 6 × (actor + critic parameters) × update tokens/s / ``--peak-tflops`` (H200 dense bf16: 989).
Peak GPU memory: the largest ``nvidia-smi`` memory.used seen by a sampler thread every 0.2 s (vLLM's
engine runs in its own process, so torch's allocator counters would miss it).
Writes every number to ``--out`` (JSON) and prints a table. Exits 2 without CUDA unless ``--rollout hf``
and ``--allow-cpu`` (the dry run).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_overhead import offline_env, run_flow  # noqa: E402
from shapes import build_shape_model, parameter_count  # noqa: E402

STAGES = ("rollout", "score", "gae", "update", "guard", "validate")


def gsm8k_like_prompts(out: Path, n: int, seed: int = 0) -> Path:
    """``n`` problems, each 1-4 embedded arithmetic problems joined (mixed lengths), as a GSM8K-format JSONL."""
    rows = [json.loads(line) for line in (REPO / "data/arith/train.jsonl").read_text().splitlines()]
    rng = random.Random(seed)
    with out.open("w") as fh:
        for i in range(n):
            parts = rng.sample(rows, rng.randint(1, 4))
            question = " Then: ".join(p["question"] for p in parts)
            fh.write(json.dumps({"question": question, "answer": parts[-1]["answer"], "id": f"mix{i}"}) + "\n")
    return out


class GpuMemorySampler:
    """Peak ``nvidia-smi`` memory.used (MiB, the largest GPU) while open."""

    def __init__(self, every_s: float = 0.2):
        self.every_s, self.peak_mib, self._stop = every_s, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=5).stdout
                self.peak_mib = max([self.peak_mib, *(int(x) for x in out.split() if x.isdigit())])
            except (OSError, subprocess.SubprocessError):
                return
            self._stop.wait(self.every_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def overrides(args, model_dir: Path, data: Path) -> list[str]:
    return [f"actor_rollout_ref.model.path={model_dir}", f"data.train_files=[{data}]", "data.val_fraction=0.0",
            f"data.train_batch_size={args.prompts}", f"data.max_response_length={args.max_response}",
            "data.max_prompt_length=512", f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts // 2}",
            f"actor_rollout_ref.rollout.name={args.rollout}", "actor_rollout_ref.rollout.generation_batch_tokens=65536",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384", "critic.ppo_max_token_len_per_gpu=16384",
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=32768",
            "actor_rollout_ref.actor.optim.lr=1e-6", "critic.optim.lr=1e-5", "trainer.test_freq=-1",
            "trainer.val_before_train=false", "trainer.kl_rollback_threshold=10", *args.override]


def iteration_rows(run_dir: Path, iterations: int, params: int, peak_tflops: float) -> list[dict]:
    rows = []
    for k in range(1, iterations + 2):
        manifest = json.loads((run_dir / f"iter_{k}" / "manifest.json").read_text())
        seconds = {s: manifest[s]["seconds"] for s in STAGES if s in manifest}
        rollout, update = manifest["rollout"].get("metrics", {}), manifest["update"].get("metrics", {})
        tokens_per_s = float(update.get("perf/tokens_per_s", 0.0))
        rows.append({
            "iteration": k, "seconds": seconds, "wall_s": sum(seconds.values()),
            "rollout_tokens_per_s": rollout.get("perf/rollout_tokens_per_s"),
            "rollout_outside_generation_s": seconds["rollout"] - float(rollout.get("perf/rollout_seconds", 0.0)),
            "update_tokens_per_s": tokens_per_s,
            "update_mfu": 6 * 2 * params * tokens_per_s / (peak_tflops * 1e12),
            "response_length_mean": rollout.get("response_length/mean"),
        })
    return rows


VERL_QUICKSTART_STEP_S = 68.0
"""Seconds per training step in verl's published quickstart run (PPO on GSM8K, Qwen2.5-0.5B-Instruct,
256 prompts a step, vLLM rollout, one GPU): the figure the issue tracker compares against."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=24, help="Qwen2.5-0.5B has 24")
    p.add_argument("--iterations", type=int, default=3, help="iterations measured (one more runs first)")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--max-response", type=int, default=256)
    p.add_argument("--rollout", choices=("vllm", "hf"), default="vllm")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--allow-cpu", action="store_true", help="the dry run on a machine without CUDA")
    p.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "bench_iteration.json")
    p.add_argument("override", nargs="*", help="extra dotted config overrides")
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        sys.exit(2)  # nothing to measure: this script is the GPU check (see --allow-cpu for the dry run)
    home = Path(tempfile.mkdtemp(prefix="rlhf-bench-iteration-"))
    home.mkdir(exist_ok=True)
    offline_env(home)
    if torch.cuda.is_available():
        os.environ.pop("DS_ACCELERATOR", None)  # offline_env pins DeepSpeed to the CPU for the CPU benchmarks
    model_dir = build_shape_model(home / "models", "qwen2.5-0.5b", args.layers)
    data = gsm8k_like_prompts(home / "prompts.jsonl", args.prompts * (args.iterations + 1))
    started = time.time()
    with GpuMemorySampler() as memory:
        run_dir, _, _, _ = run_flow(home, args.iterations + 1, overrides(args, model_dir, data))
    rows = iteration_rows(run_dir, args.iterations, parameter_count(model_dir), args.peak_tflops)
    result = {"layers": args.layers, "prompts": args.prompts, "max_response": args.max_response,
              "rollout": args.rollout, "parameters": parameter_count(model_dir), "flow_s": time.time() - started,
              "peak_gpu_memory_mib": memory.peak_mib, "iterations": rows}
    args.out.write_text(json.dumps(result, indent=2))
    print(f"{args.layers} layers ({result['parameters'] / 1e6:.0f} M parameters), {args.prompts} prompts, "
          f"responses <= {args.max_response} tokens, rollout {args.rollout}; peak GPU memory {memory.peak_mib} MiB")
    print("iter  " + "".join(f"{s:>9}" for s in STAGES) + "   wall s  rollout tok/s  outside-gen s  update tok/s    MFU")
    for r in rows:
        cells = "".join(f"{r['seconds'].get(s, 0.0):9.2f}" for s in STAGES)
        print(f"{r['iteration']:>4}  {cells} {r['wall_s']:8.2f}  {r['rollout_tokens_per_s'] or 0:13.0f}  "
              f"{r['rollout_outside_generation_s']:13.2f}  {r['update_tokens_per_s']:12.0f}  {100 * r['update_mfu']:5.1f}%")
    print(f"(iteration 1 includes the engines' start-up; written to {args.out})")
    measured = sorted(r["wall_s"] for r in rows[1:]) or [rows[0]["wall_s"]]
    median = measured[len(measured) // 2]
    print(f"median iteration {median:.1f} s against verl's quickstart ~{VERL_QUICKSTART_STEP_S:.0f} s a step "
          f"(same scale: 256 prompts, Qwen2.5-0.5B, vLLM; verl's real 151,936-token vocabulary and GSM8K prompts): "
          f"{VERL_QUICKSTART_STEP_S / median:.2f}x")


if __name__ == "__main__":
    main()
