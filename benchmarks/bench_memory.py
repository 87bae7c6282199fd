"""Peak resident memory of the update stage against the analytic size of what training must hold:
weights + gradients + Adam's two moments = 4 × parameters × 4 bytes (fp32), for the actor and the critic.

    python benchmarks/bench_memory.py [--shapes 64x2 256x4 512x8] [--sequences 32] [--zero 0]

Each shape (hidden × layers; Qwen2 layout with the tiny model's 512-token vocabulary, 4 heads, 2 KV heads,
intermediate ≈ 2.75 × hidden) is built with ``rlhf_core.models.tiny.build_tiny_model`` and trained by
``rlhf_core.training.run_trainer.one_update_trainer`` (the body of ``rlhf stage update``) in a fresh process on a
synthetic advantages table of ``--sequences`` rows (prompts 80-110 tokens, responses 32: the demo's shapes).

Columns: params (actor / critic), ``state GB`` = 16 bytes × (actor + critic parameters), ``base GB`` =
the process's resident memory just before one_update_trainer's update (Python, torch, transformers, DeepSpeed imported,
table built), ``peak GB`` = VmHWM during one_update_trainer's update (perf/peak_rss_gb: setup, PPO loop; the window
starts at one_update_trainer's update), ``peak/state`` and ``(peak−base)/state``: what the update adds per byte of
training state (activations, DeepSpeed buffers, the loaded checkpoint copies, allocator slack).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from arguments import positive_int, tiny_hidden_size, zero_stage  # noqa: E402

BYTES_PER_PARAM = 4 * 4  # fp32 weight + fp32 grad + Adam exp_avg + exp_avg_sq


def hidden_x_layers(text: str) -> str:
    """A ``--shapes`` entry, HIDDENxLAYERS (kept as text: it names the shape's row and files)."""
    hidden, x, layers = text.partition("x")
    if not (x and hidden.isdigit() and layers.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r} is not HIDDENxLAYERS (e.g. 256x4)")
    for part, what, check in ((hidden, "the hidden size", tiny_hidden_size), (layers, "the layers", positive_int)):
        try:
            check(part)
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {what} {exc}") from None
    return text


def vm_rss_gb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024 ** 2
    return float("nan")


def count_params(model_dir: Path) -> tuple[int, int]:
    """(actor, critic) parameter counts: the causal LM, and its backbone + a hidden→1 value head."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    actor = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    backbone = AutoModel.from_pretrained(model_dir, dtype=torch.float32)
    n_actor = sum(p.numel() for p in actor.parameters())
    n_critic = sum(p.numel() for p in backbone.parameters()) + actor.config.hidden_size + 1
    return n_actor, n_critic


def worker(hidden: int, layers: int, sequences: int, zero: int, out: Path) -> None:
    from rlhf_core.config import load_config
    from rlhf_core.data.schemas import ADVANTAGES
    from rlhf_core.io.atomic import atomic_write_parquet
    from rlhf_core.run.layout import RunDir
    from rlhf_core.models.tiny import TinyModelSpec, build_tiny_model
    from rlhf_core.training.synthetic import synthetic_advantages
    from rlhf_core.training.run_trainer import one_update_trainer

    home = Path(os.environ["RLHF_HOME"])
    model_dir = home / f"model_{hidden}x{layers}"
    build_tiny_model(model_dir, TinyModelSpec(hidden_size=hidden, num_hidden_layers=layers,
                                              intermediate_size=int(hidden * 2.75) // 16 * 16))
    n_actor, n_critic = count_params(model_dir)
    run = RunDir(home / f"run_{hidden}x{layers}")
    table = synthetic_advantages(model_dir, sequences, seed=0, prompt_len=(80, 110), response_len=(32, 32))
    atomic_write_parquet(run.advantages(1), table, ADVANTAGES)
    cfg = load_config(str(REPO / "configs/demo.yaml"), [
        f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.model.warm_start.enable=false",
        f"data.train_batch_size={sequences}", f"actor_rollout_ref.actor.ppo_mini_batch_size={min(32, sequences)}",
        f"actor_rollout_ref.actor.deepspeed_config.zero_stage={zero}", f"critic.deepspeed_config.zero_stage={zero}"])
    base = vm_rss_gb()
    with one_update_trainer(cfg, run, 1) as trainer:
        metrics = trainer.update(cfg, 1, progress=False)
    out.write_text(json.dumps({"actor_params": n_actor, "critic_params": n_critic, "base_gb": base,
                               "peak_gb": metrics["perf/peak_rss_gb"], "tokens_per_s": metrics["perf/tokens_per_s"]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", type=hidden_x_layers, default=["64x2", "256x4", "512x8"],
                        help="HIDDENxLAYERS")
    parser.add_argument("--sequences", type=positive_int, default=32)
    parser.add_argument("--zero", type=zero_stage, default=0, help="ZeRO stage of actor and critic")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        hidden, layers = map(int, args.worker[0].split("x"))
        worker(hidden, layers, int(args.worker[1]), args.zero, Path(args.worker[2]))
        return
    results = {}
    with tempfile.TemporaryDirectory(prefix="rlhf-bench-memory-") as home:
        env = dict(os.environ, RLHF_HOME=home, DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        for shape in args.shapes:
            out = Path(home) / f"{shape}.json"
            proc = subprocess.run([sys.executable, __file__, "--worker", shape, str(args.sequences), str(out),
                                   "--zero", str(args.zero)], env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"error: shape {shape} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            results[shape] = json.loads(out.read_text())
    print(f"update stage, ZeRO {args.zero}, fp32, {args.sequences} sequences (prompts 80-110 + 32 response tokens), 1 process")
    print(f"{'shape':>7} {'actor params':>12} {'critic params':>13} {'state GB':>9} {'base GB':>8} {'peak GB':>8} "
          f"{'peak/state':>10} {'(peak-base)/state':>17} {'tokens/s':>9}")
    for shape, r in results.items():
        state = (r["actor_params"] + r["critic_params"]) * BYTES_PER_PARAM / 1024 ** 3
        print(f"{shape:>7} {r['actor_params']:>12,} {r['critic_params']:>13,} {state:>9.3f} {r['base_gb']:>8.3f} "
              f"{r['peak_gb']:>8.3f} {r['peak_gb'] / state:>10.1f} {(r['peak_gb'] - r['base_gb']) / state:>17.2f} "
              f"{r['tokens_per_s']:>9.0f}")


if __name__ == "__main__":
    main()
