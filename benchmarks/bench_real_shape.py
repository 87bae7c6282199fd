"""Ours against TRL's PPOTrainer at a real layer shape, whole iterations, same work, measured side by
side in one run. Goal (issue 30): ours >= 1.5x TRL's whole iteration at Qwen2.5-0.5B's shape.

    python benchmarks/bench_real_shape.py [--layers 4 8] [--dtype auto fp32 bf16] [--iterations 3] [--repeats 2]
                                          [--batch 8] [--response-length 32] [--trl-threads 2]
                                          [--bypass] [--sampled-guard] [--ours-override KEY=VALUE ...] [--only ours|trl]

The model: Qwen2.5-0.5B's layer shape (hidden 896, 14 heads, 2 KV heads, intermediate 4864) cut to
``--layers`` layers, random weights, the project's tiny tokenizer (benchmarks/shapes.py; 4 layers = 60 M
parameters, 8 = 120 M). Built once under .rlhf/models/shapes. Each ``--dtype`` runs both sides:
``auto`` (the default) is ours with its defaults — ``deepspeed_config.dtype: auto``, bf16 only on a CPU
whose bf16 matmuls measure well faster than its fp32 ones, at this size; fp32 elsewhere — against TRL in
fp32, its faster setting on every CPU measured (§8); ``fp32`` is both sides in fp32; ``bf16`` both in bf16 mixed precision (TRL:
``bf16=True``, accelerate's autocast; ours: DeepSpeed bf16 at ZeRO 1 for actor and critic, fp32 master
weights, and the rollout, scoring and guard in bf16). The CPU's model and flags, torch's threads and
the load average are printed beside the ratios, with the measured bf16 and fp32 matmul rates (the
machines here differ: some have AVX512-BF16, and on some of those bf16 is the slower).

The work, per iteration, on both sides: ``--batch`` prompts of the demo's prompt file in the model's
chat template (the very token ids our run sampled, given to TRL in the same order), up to
``--response-length`` sampled tokens, one PPO epoch on one mini-batch of all the prompts.
  ours — ``rlhf run`` (flows.pipeline.rlhf_pipeline: every stage task, manifests, checkpoints, MLflow,
         Prefect) on configs/demo.yaml without the SFT warm start and without validation (TRL validates
         nothing), save_freq 10, actor lr 1e-6 (as TRL's; random weights leave the KL bound at the
         demo's 1e-4), otherwise its defaults: rollout (hf engine), score (reference log-probs, critic
         values, rule reward; old log-probs the rollout's own where they are the trainer's arithmetic:
         actor_rollout_ref.rollout.old_log_probs=auto), gae, update (critic + actor through DeepSpeed),
         the exact KL guard (the new actor's pass and the reference's LM head on the states scoring
         kept). ``--bypass`` adds verl's bypass mode, ``--sampled-guard`` the one-pass sampled guard
         (both were the speed settings of the first measurement). Phases: each stage body's seconds
         from iter_K/manifest.json, beside its floor (model FLOPs at the measured matmul rate:
         perf/stage_floor_seconds/<stage>); the rest of the iteration's wall (Prefect, MLflow,
         bookkeeping) is "around the stages".
  TRL  — ``PPOTrainer.train()`` (trl 1.12.0, its own venv as in bench_vs_trl.py) with its separate value
         and reward models (sequence-classification heads on the same weights); phases by wrapping its
         module's functions: generation (``batch_generation``), scoring (end of generation → first
         forward with gradients: ref log-probs, values, reward, GAE), update (first forward with
         gradients → last optimizer step), and the rest (its logging, bookkeeping).
Iteration k's wall = start of generation k+1 - start of generation k on both sides; iteration 1 (warm-up:
first allocations, DeepSpeed engines) is excluded, ``--iterations`` more are measured, and the last one
run only ends the one before. Each run is a fresh process; the sides alternate (ours, TRL, ours, TRL,
...) so that drift of the machine hits both; per phase the median over all measured iterations of all
runs is shown. Ratio = TRL's whole iteration / ours (> 1: ours is faster). Results: docs/benchmarks.md §8.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from arguments import nonnegative_int, output_dir, override, positive_int  # noqa: E402
from bench_vs_trl import _trl_models, ensure_trl_venv, median, run_worker  # noqa: E402  (stdlib-only at import: the TRL venv imports it too)

OUR_PHASES = ("rollout", "score", "gae", "update", "guard")
FLOORED = ("rollout", "score", "update", "guard")
BYPASS = ("algorithm.rollout_correction.bypass_mode=true",)
"""verl's bypass mode (--bypass): the rollout's log-probs are the old policy and its loss corrects the gap
(the default, rollout.old_log_probs=auto, takes them too here, with the ordinary loss)."""
SAMPLED_GUARD = ("trainer.kl_guard_estimator=sampled",)
"""The guard's KL from the new actor's pass alone (--sampled-guard; the default is the exact measure)."""
BF16 = tuple(f"{role}.deepspeed_config.{key}" for role in ("actor_rollout_ref.actor", "critic")
             for key in ("dtype=bf16", "zero_stage=1"))
FP32 = tuple(f"{role}.deepspeed_config.dtype=fp32" for role in ("actor_rollout_ref.actor", "critic"))
"""bf16 mixed precision (fp32 master weights and moments; DeepSpeed's bf16 needs ZeRO >= 1, which on one
process holds the same tensors as stage 0); rollout, scoring and the guard then run in bf16 too."""
TRL_PHASES = ("generation", "scoring", "update", "rest")


# ----------------------------------------------------------------------------- TRL side (its venv)

def trl_worker(spec: dict, out: Path) -> None:
    """``iterations`` + 2 PPOTrainer updates; per update the start of generation and its phase marks."""
    import torch
    from datasets import Dataset

    import trl
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as mod

    tok, policy, ref, reward, value = _trl_models(spec)
    marks: list[dict] = []
    real_generation, real_forward = mod.batch_generation, mod.forward

    def timed_generation(*args, **kwargs):
        marks.append({"gen_start": time.perf_counter()})
        result = real_generation(*args, **kwargs)
        marks[-1]["gen_end"] = time.perf_counter()
        marks[-1]["width"] = int(result[0].shape[1] - args[1].shape[1])
        return result

    def timed_forward(model, *args, **kwargs):
        if torch.is_grad_enabled() and marks and "train_first" not in marks[-1]:
            marks[-1]["train_first"] = time.perf_counter()
        return real_forward(model, *args, **kwargs)

    mod.batch_generation, mod.forward = timed_generation, timed_forward
    updates = spec["iterations"] + 2
    args = PPOConfig(
        output_dir=str(out.parent / "trl_out"), per_device_train_batch_size=spec["batch"], gradient_accumulation_steps=1,
        num_mini_batches=1, num_ppo_epochs=1, response_length=spec["response_length"],
        total_episodes=spec["batch"] * updates, local_rollout_forward_batch_size=spec["batch"],
        num_sample_generations=0, use_cpu=True, report_to=[], save_strategy="no", learning_rate=1e-6,  # = ours' actor lr
        seed=spec["seed"], stop_token="eos", logging_steps=1, bf16=spec["dtype"] == "bf16", fp16=False)
    # one dataset row per (iteration, prompt), in our order; TRL's dataloader must not reshuffle it
    trainer = PPOTrainer(args=args, processing_class=tok, model=policy, ref_model=ref, reward_model=reward,
                         train_dataset=Dataset.from_dict({"input_ids": spec["prompts"]}), value_model=value)
    trainer.dataloader = torch.utils.data.DataLoader(trainer.train_dataset, batch_size=spec["batch"], shuffle=False,
                                                     collate_fn=trainer.dataloader.collate_fn, drop_last=True)
    torch_optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate wraps it
    torch_optimizer.register_step_post_hook(lambda *_: marks[-1].__setitem__("step_end", time.perf_counter()))
    trainer.train()  # the last update only ends the one before (as on our side)
    iterations = []
    for this, following in zip(marks, marks[1:]):
        wall = following["gen_start"] - this["gen_start"]
        phases = {"generation": this["gen_end"] - this["gen_start"], "scoring": this["train_first"] - this["gen_end"],
                  "update": this["step_end"] - this["train_first"]}
        iterations.append({"wall": wall, **phases, "rest": wall - sum(phases.values()), "width": this["width"]})
    out.write_text(json.dumps({"trl_version": trl.__version__, "threads": torch.get_num_threads(),
                               "iterations": iterations}))


# ----------------------------------------------------------------------------- our side (project venv)

def ours_worker(spec: dict, out: Path) -> None:
    """``iterations`` + 2 iterations of the real flow in a fresh RLHF_HOME; per iteration its wall and
    each stage body's seconds, and the prompts it sampled (token ids, in order)."""
    sys.path.insert(0, str(REPO))
    from bench_overhead import offline_env, run_flow
    import pyarrow.parquet as pq

    from rlhf_core.run.layout import RunDir

    home = out.parent / f"ours_home_{os.getpid()}"
    home.mkdir()  # Prefect creates its database under PREFECT_HOME only when the parent exists
    offline_env(home)
    overrides = [f"actor_rollout_ref.model.path={spec['model_dir']}", "trainer.test_freq=-1",
                 "trainer.val_before_train=false", "trainer.save_freq=10", f"data.train_batch_size={spec['batch']}",
                 f"data.max_response_length={spec['response_length']}",
                 f"actor_rollout_ref.actor.ppo_mini_batch_size={spec['batch']}", "actor_rollout_ref.actor.ppo_epochs=1",
                 f"trainer.seed={spec['seed']}", "actor_rollout_ref.actor.optim.lr=1e-6", "critic.optim.lr=1e-5",
                 *(BYPASS if spec["bypass"] else ()), *(SAMPLED_GUARD if spec["sampled_guard"] else ()),
                 *(BF16 if spec["dtype"] == "bf16" else FP32 if spec["dtype"] == "fp32" else ()),
                 *spec["ours_overrides"]]  # random weights: the demo's lr 1e-4 leaves the KL bound in a few steps
    updates = spec["iterations"] + 2
    run_dir, _, _, _ = run_flow(home, updates, overrides)
    run = RunDir(run_dir)
    manifests = [run.read_json(run.manifest_path(k)) for k in range(1, updates + 1)]
    starts = [m["rollout"]["started_at"] for m in manifests]  # the last iteration (flow's end, final save) only ends the one before
    iterations, prompts = [], []
    for k, (manifest, start, end) in enumerate(zip(manifests, starts, starts[1:]), start=1):
        phases = {stage: manifest[stage]["seconds"] for stage in OUR_PHASES if stage in manifest}
        reported = run.read_json(run.iteration_metrics(k)) or {}
        floors = {f"floor {stage}": reported[f"perf/stage_floor_seconds/{stage}"] for stage in FLOORED
                  if f"perf/stage_floor_seconds/{stage}" in reported}
        rollout = pq.read_table(run.rollout(k), columns=["prompt_token_ids", "response_length"])
        prompts.extend(rollout.column("prompt_token_ids").to_pylist())
        lengths = rollout.column("response_length").to_pylist()
        iterations.append({"wall": end - start, **phases, "around the stages": end - start - sum(phases.values()),
                           "width": max(lengths), "mean_length": sum(lengths) / len(lengths), **floors,
                           "old log-probs from the rollout": reported.get("score/old_log_probs_from_rollout"),
                           "old log-prob gap": reported.get("actor/old_log_prob_diff_max")})
    last = pq.read_table(run.rollout(updates), columns=["prompt_token_ids"])  # TRL samples one batch per update
    prompts.extend(last.column("prompt_token_ids").to_pylist())
    out.write_text(json.dumps({"iterations": iterations, "prompts": prompts}))


# ----------------------------------------------------------------------------- driver

def measured(runs: list[dict]) -> list[dict]:
    """Every run's iterations after the first (warm-up) one."""
    return [it for r in runs for it in r["iterations"][1:]]


def walls(rows: list[dict]) -> str:
    return ", ".join(f"{r['wall']:.2f}" for r in rows)


def table(layers: int, params: float, ours: list[dict], trl: list[dict], spec: dict) -> str:
    """The per-phase markdown table of one shape, with ours' floors and the ratio."""
    o, t = measured(ours), measured(trl)
    med = lambda rows, key: median([r[key] for r in rows if r.get(key) is not None])  # noqa: E731
    has = lambda rows, key: any(r.get(key) is not None for r in rows)  # noqa: E731
    floor = lambda stage: f"{med(o, 'floor ' + stage):.2f} s" if has(o, "floor " + stage) else "—"  # noqa: E731
    ow, tw = med(o, "wall"), med(t, "wall")
    settings = [("verl's bypass mode" if spec["bypass"] else "old log-probs by rollout.old_log_probs=auto"),
                ("sampled" if spec["sampled_guard"] else "exact") + " KL guard",
                {"auto": "deepspeed_config.dtype auto", "fp32": "fp32", "bf16": "bf16"}[spec["dtype"]]]
    trl_dtype = "bf16" if spec["dtype"] == "bf16" else "fp32"
    lines = [f"### {layers} layers of Qwen2.5-0.5B's shape ({params:.0f} M parameters), ours {spec['dtype']} "
             f"against TRL {trl_dtype}, {spec['batch']} prompts (mean {spec['prompt_tokens']:.0f} tokens), "
             f"<= {spec['response_length']} response tokens; {len(o)} iterations of ours, {len(t)} of TRL measured, medians",
             f"ours: {', '.join(settings)}" + (f", {' '.join(spec['ours_overrides'])}" if spec["ours_overrides"] else ""),
             "", f"| per iteration | TRL {trl[0]['trl_version']} ({trl[0]['threads']} threads) | ours | ours' floor |",
             "|---|---|---|---|",
             f"| **whole iteration** | **{tw:.2f} s** | **{ow:.2f} s** | |",
             f"| generation / rollout | {med(t, 'generation'):.2f} s | {med(o, 'rollout'):.2f} s | {floor('rollout')} |",
             f"| scoring (TRL: policy, ref, value, reward, GAE) / score + gae | {med(t, 'scoring'):.2f} s | "
             f"{med(o, 'score'):.2f} + {med(o, 'gae'):.2f} s | {floor('score')} |",
             f"| policy + value update | {med(t, 'update'):.2f} s | {med(o, 'update'):.2f} s | {floor('update')} |",
             (f"| KL guard | — | {med(o, 'guard'):.2f} s | {floor('guard')} |" if has(o, "guard") else "| KL guard | — | — | |"),
             f"| the rest (logging, bookkeeping, orchestration) | {med(t, 'rest'):.2f} s | "
             f"{med(o, 'around the stages'):.2f} s | |",
             f"| sampled width (TRL) / longest response (ours) | {med(t, 'width'):.0f} | {med(o, 'width'):.0f} | |",
             "", f"ratio TRL / ours, whole iteration: **{tw / ow:.2f}x** (goal >= 1.5x); whole iterations ours: "
             f"{walls(o)}; TRL: {walls(t)}"]
    if has(o, "old log-prob gap"):
        lines.append(f"ours' old log-probs from the rollout in {sum(bool(r.get('old log-probs from the rollout')) for r in o)}"
                     f" of {len(o)} iterations; largest |log pi - old| at the update's start "
                     f"{max(r['old log-prob gap'] for r in o if r.get('old log-prob gap') is not None):.2g}")
    return "\n".join(lines)


def machine() -> str:
    """This machine's CPU (model, the flags that decide bf16's speed, the matmul rates that decide
    ``dtype: auto``), torch's threads and the load."""
    import torch

    from rlhf_core.training import hardware

    model, flags = hardware.cpu_description()
    shown = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16") if f in flags]
    pays = hardware.cpu_bf16_pays()
    return (f"CPU: {model}, {os.cpu_count()} cores, flags {' '.join(shown) or '(none of avx2/avx512/amx)'}; "
            f"{hardware.bf16_judgment()}: dtype auto picks {'bf16' if pays else 'fp32'} at these shapes; "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads; load average {load()}")


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=positive_int, nargs="+", default=[4, 8])
    parser.add_argument("--iterations", type=positive_int, default=3, help="iterations measured per run (after a warm-up one)")
    parser.add_argument("--repeats", type=positive_int, default=2, help="runs per side and shape, interleaved")
    parser.add_argument("--batch", type=positive_int, default=8)
    parser.add_argument("--response-length", type=positive_int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trl-threads", type=nonnegative_int, default=2, help="torch threads of TRL (0: torch's own choice)")
    parser.add_argument("--dtype", nargs="+", choices=("auto", "fp32", "bf16"), default=["auto"],
                        help="auto: ours with its default dtype against TRL in fp32; fp32: both in fp32; bf16: "
                             "both in bf16 mixed precision (TRL: bf16=True, autocast)")
    parser.add_argument("--ours-override", action="append", type=override, default=[], metavar="KEY=VALUE")
    parser.add_argument("--bypass", action="store_true", help="ours with verl's bypass mode")
    parser.add_argument("--sampled-guard", action="store_true", help="ours with trainer.kl_guard_estimator=sampled "
                        "(one pass) instead of the default exact KL")
    parser.add_argument("--only", choices=("ours", "trl"), help="run one side only (a quick look; no ratio)")
    parser.add_argument("--model-cache", type=output_dir, default=REPO / ".rlhf" / "models" / "shapes")
    parser.add_argument("--venv", type=Path, default=Path(tempfile.gettempdir()) / "rlhf-bench-trl-venv")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        role, spec_path, out = args.worker
        {"trl": trl_worker, "ours": ours_worker}[role](json.loads(Path(spec_path).read_text()), Path(out))
        return
    from shapes import build_shape_model, parameter_count

    trl_python = None if args.only == "ours" else str(ensure_trl_venv(args.venv))
    sys.path.insert(0, str(REPO))
    reports = [machine()]
    print(reports[0], flush=True)
    with tempfile.TemporaryDirectory(prefix="rlhf-bench-shape-") as tmp:
        work = Path(tmp)
        env = dict(os.environ, DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   TOKENIZERS_PARALLELISM="false", DO_NOT_TRACK="1")
        for layers, dtype in [(n, d) for n in args.layers for d in args.dtype]:
            model_dir = build_shape_model(args.model_cache, "qwen2.5-0.5b", layers, args.seed)
            spec = {"model_dir": str(model_dir), "batch": args.batch, "iterations": args.iterations, "dtype": dtype,
                    "bypass": args.bypass, "sampled_guard": args.sampled_guard, "response_length": args.response_length,
                    "seed": args.seed, "trl_threads": args.trl_threads, "ours_overrides": args.ours_override}
            ours, trl = [], []
            for repeat in range(args.repeats):
                if args.only != "trl" or "prompts" not in spec:
                    result = run_worker(sys.executable, "ours", spec, work, env, __file__)
                    spec["prompts"] = result["prompts"]  # TRL samples from exactly these prompts, in this order
                    if args.only != "trl":
                        ours.append(result)
                if args.only != "ours":
                    trl.append(run_worker(trl_python, "trl", spec, work, env, __file__))
                print(f"{layers} layers, {dtype}: run {repeat + 1}/{args.repeats} done (load average {load()})",
                      file=sys.stderr)
            spec["prompt_tokens"] = sum(map(len, spec["prompts"])) / len(spec["prompts"])
            params = parameter_count(model_dir) / 1e6
            if ours and trl:
                reports.append(table(layers, params, ours, trl, spec))
            else:
                side = ours or trl
                reports.append(f"{layers} layers, {dtype}, {'ours' if ours else 'TRL'} only: " + json.dumps(
                    {k: round(median([it[k] for it in measured(side) if k in it]), 3)
                     for k in measured(side)[0] if k != "width"}))
            print(reports[-1], flush=True)
    reports.append(machine())
    print("\n\n".join(reports))


if __name__ == "__main__":
    main()
