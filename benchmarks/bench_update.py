"""PPO update throughput and peak memory of the tiny model at ZeRO 0, 2 and 3 (CPU, fp32, 1 process).

    python benchmarks/bench_update.py [--sequences 64] [--stages 0 2 3] [--epochs 1] [--seed 0]

Data: the embedded arithmetic problems (data/arith/train.jsonl) in the tiny model's chat template,
each followed by its reference solution + EOS as the response (the demo's shapes: prompts ~85-111
tokens, responses ~20-45), old/ref log-probs scored by the model, seeded Gaussian advantages. The
update runs as the stage does (``one_update_trainer``'s update: critic and actor — at the same time on >= 2 cores —,
mini-batches of 32, token budget 2048, checkpoint written), each ZeRO stage in a fresh process so
peak RSS is its own.

Columns: ``tokens/s`` = perf/tokens_per_s (batch tokens × epochs / update-loop seconds, actor and
critic both trained), ``actor tok/s`` / ``critic tok/s`` = each model's forward+backward rate,
``loop s`` = the PPO loop, ``setup s`` = process group + models + DeepSpeed engines, ``ckpt s`` =
writing the checkpoint, ``total s`` = one_update_trainer's update end to end, ``peak RSS GB`` = the process's peak resident memory. Wall-clock on this machine:
other load on the CPUs shows up in the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from arguments import positive_int, zero_stage  # noqa: E402


def arith_pairs(tokenizer, n: int) -> list[tuple[list[int], list[int]]]:
    rows = [json.loads(line) for line in (REPO / "data/arith/train.jsonl").read_text().splitlines()[:n]]
    pairs = []
    for r in rows:
        text = tokenizer.apply_chat_template([{"role": "user", "content": r["question"]}],
                                             add_generation_prompt=True, tokenize=False)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        response = tokenizer(r["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        pairs.append((prompt, response))
    return pairs


def worker(stage: int, sequences: int, epochs: int, seed: int, out: Path) -> None:
    """One ZeRO stage in this process: build the run, time one_update_trainer's update, write the numbers."""
    from transformers import AutoTokenizer

    from rlhf_core.config import load_config
    from rlhf_core.data.schemas import ADVANTAGES
    from rlhf_core.io.atomic import atomic_write_parquet
    from rlhf_core.run.layout import RunDir
    from rlhf_core.run.models import initial_actor_path
    from rlhf_core.stages.init_critic import run_init_critic as ensure_initial_critic
    from rlhf_core.training.synthetic import synthetic_advantages
    from rlhf_core.training.run_trainer import one_update_trainer

    # the demo's SFT warm start changes the weights, not the update's cost: skip it here
    cfg = load_config(str(REPO / "configs/demo.yaml"), [
        f"actor_rollout_ref.actor.deepspeed_config.zero_stage={stage}", f"critic.deepspeed_config.zero_stage={stage}",
        f"actor_rollout_ref.actor.ppo_epochs={epochs}", f"trainer.seed={seed}",
        "actor_rollout_ref.model.warm_start.enable=false"])
    model = initial_actor_path(cfg)  # what one_update_trainer's update starts from, so old log-probs match it
    run = RunDir(Path(os.environ["RLHF_HOME"]) / f"run_zero{stage}")
    table = synthetic_advantages(model, pairs=arith_pairs(AutoTokenizer.from_pretrained(model), sequences), seed=seed)
    atomic_write_parquet(run.advantages(1), table, ADVANTAGES)
    ensure_initial_critic(cfg, run)  # built once per run anyway; kept out of the timing
    started = time.perf_counter()
    with one_update_trainer(cfg, run, 1) as trainer:
        metrics = trainer.update(cfg, 1, progress=False)
    metrics["total_seconds"] = time.perf_counter() - started
    metrics["batch_tokens"] = float(sum(len(p) + len(r) for p, r in zip(table["prompt_token_ids"].to_pylist(),
                                                                       table["response_token_ids"].to_pylist())))
    out.write_text(json.dumps(metrics))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sequences", type=positive_int, default=64)
    parser.add_argument("--stages", type=zero_stage, nargs="+", default=[0, 2, 3])
    parser.add_argument("--epochs", type=positive_int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker-stage", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_stage is not None:
        worker(args.worker_stage, args.sequences, args.epochs, args.seed, args.worker_out)
        return

    with tempfile.TemporaryDirectory() as home:
        env = dict(os.environ, RLHF_HOME=home, DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        results = {}
        for stage in args.stages:
            out = Path(home) / f"zero{stage}.json"
            subprocess.run([sys.executable, __file__, "--worker-stage", str(stage), "--worker-out", str(out),
                            "--sequences", str(args.sequences), "--epochs", str(args.epochs), "--seed", str(args.seed)],
                           env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            results[stage] = json.loads(out.read_text())
    first = next(iter(results.values()))
    print(f"{args.sequences} sequences, {int(first['batch_tokens'])} tokens, {args.epochs} epoch(s), "
          f"{int(first['actor/num_steps'])} actor + {int(first['critic/num_steps'])} critic steps, "
          f"{int(first['perf/threads_per_rank'])} thread(s)")
    print(f"{'ZeRO':>4} {'tokens/s':>9} {'actor tok/s':>12} {'critic tok/s':>13} {'loop s':>7} {'setup s':>8} "
          f"{'ckpt s':>7} {'total s':>8} {'peak RSS GB':>12}")
    for stage, m in results.items():
        print(f"{stage:>4} {m['perf/tokens_per_s']:>9.0f} {m['perf/actor_tokens_per_s']:>12.0f} "
              f"{m['perf/critic_tokens_per_s']:>13.0f} {m['perf/update_seconds']:>7.2f} {m['perf/setup_seconds']:>8.2f} "
              f"{m['perf/checkpoint_seconds']:>7.2f} {m['total_seconds']:>8.2f} {m['perf/peak_rss_gb']:>12.3f}")


if __name__ == "__main__":
    main()
