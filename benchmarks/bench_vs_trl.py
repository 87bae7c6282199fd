"""Ours against TRL's PPOTrainer on CPU, measured side by side in one run, on the same tiny model and
the same work. Goal: ours >= 1.5x TRL.

    # whole iterations (default): generation, scoring, update and every cost around them
    python benchmarks/bench_vs_trl.py [--iterations 5] [--repeats 3] [--trl-threads 2]
                                      [--batch 64] [--mini-batch 32] [--response-length 32] [--epochs 1]
                                      [--ours-override trainer.resident_models=false]
    # the PPO update alone (update tokens/s)
    python benchmarks/bench_vs_trl.py --mode update [--batch 64] [--mini-batch 32] [--response-length 32]
                                      [--epochs 2] [--hidden 64 --layers 2 --intermediate 176]
                                      [--trl-threads 1 0] [--token-budget 2048] [--repeats 3]
    [--venv /tmp/rlhf-bench-trl-venv]

TRL runs in its own throwaway virtual environment (created on first use, reused after): torch==2.13.0
(the local CPU wheel, installed first so nothing pulls a CUDA build), then trl==1.12.0 and
transformers==5.24.0. In trl 1.12.0 the PPOTrainer lives in ``trl.experimental.ppo``. Without network
the venv cannot be built: the script says so and exits 2.

What is measured, --mode iteration (whole iterations, the demo's shapes):
  ours — ``flows.pipeline.rlhf_pipeline`` (the real flow: every stage task — rollout, score, gae, update,
         KL guard — with its manifests, tables and checkpoints, MLflow, Prefect, the background
         reporter) on configs/demo.yaml without the SFT warm start and without validation (TRL
         validates nothing here either), ``--iterations`` + 1 iterations in a fresh process and
         RLHF_HOME; iteration k's time = start of rollout k+1 − start of rollout k. Threads: its own
         choice (the update trains critic and actor at once on 2 cores).
  TRL  — ``PPOTrainer.train()`` over ``--iterations`` + 1 updates of ``--batch`` prompts of the same
         prompt file (data/arith/demo.jsonl): generation (stopping at EOS, as ours), policy/ref log-probs,
         values, reward model (a sequence-classification head on the same model; ours scores by rule),
         GAE, the PPO epochs, its logging; update k's time = start of generation k+1 − start of
         generation k; ``--trl-threads`` torch threads (default 2 = the machine).
  Start-up (model loads, Prefect server, preprocessing) is excluded on both sides and printed apart.
  Reported: seconds per iteration each (median over ``--repeats`` runs of each run's mean) and the
  ratio TRL/ours (> 1: ours is faster).

What is measured, --mode update:
  TRL  — one ``PPOTrainer.train()`` update of ``--batch`` prompts (the demo's arithmetic prompts in the
         tiny model's chat template), ``--response-length`` sampled tokens each (no stop token, so every
         response has exactly that length). Phases timed by wrapping the trainer module's functions:
         generation (``batch_generation``), scoring (policy/ref log-probs, values, reward, GAE: from the
         end of generation to the first forward with gradients) and training (the PPO epochs: first
         grad-enabled forward → last optimizer step). One AdamW over policy+value (TRL's design).
  ours — the same prompts and the very responses TRL generated, as an advantages table
         (``rlhf_core.training.synthetic.synthetic_advantages``: old/ref log-probs scored by the model =
         our scoring phase), then ``rlhf_core.training.run_trainer.one_update_trainer`` (what ``rlhf stage update``
         runs: critic and actor through DeepSpeed ZeRO on CPU, packed micro-batches) with the same
         epochs and mini-batch size. Phases: scoring, setup (engines), update loop, checkpoint.
  update tokens/s = real (non-pad) prompt+response tokens × epochs / training-phase seconds, for both.
Each side runs in a fresh process, one after the other, ``--repeats`` times interleaved; medians are
reported. TRL runs at each ``--trl-threads`` setting (default: 1 thread, and torch's own choice = all
cores); ours runs as the update stage would (1 thread per model whose largest weight matrix is under 1 M elements, the critic and
the actor at the same time when there are >= 2 cores: ``trainer.concurrent_critic_actor``), so the
ratio against TRL at all cores compares both using the whole machine.
Results and their analysis: docs/benchmarks.md §3.
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

from arguments import nonnegative_int, override, positive_int, tiny_hidden_size  # stdlib only, as this module must be

REPO = Path(__file__).resolve().parent.parent
TRL_VERSION = "1.12.0"
PINS = (["torch==2.13.0"], [f"trl=={TRL_VERSION}", "transformers==5.24.0"])


# ----------------------------------------------------------------------------- TRL side (its venv)

def _trl_models(spec: dict):
    """(tokenizer, policy, reference, reward model, value model) on the spec's model, seeded and at
    the spec's thread count, as both TRL workers build them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(spec["seed"])
    if spec.get("trl_threads"):
        torch.set_num_threads(spec["trl_threads"])
    model_dir = spec["model_dir"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    reward = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
    value = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
    for m in (reward, value):
        m.config.pad_token_id = tok.pad_token_id
    return tok, policy, ref, reward, value


def trl_worker(spec: dict, out: Path) -> None:
    """Run one PPOTrainer update in this (TRL venv) process; write phase times and the generations."""
    import torch
    from datasets import Dataset

    import trl
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as mod

    tok, policy, ref, reward, value = _trl_models(spec)
    marks: dict = {"train_first": None, "step_end": None}
    captured = {}

    real_generation, real_forward = mod.batch_generation, mod.forward

    def timed_generation(*args, **kwargs):
        marks["gen_start"] = time.perf_counter()
        result = real_generation(*args, **kwargs)
        marks["gen_end"] = time.perf_counter()
        captured["queries"], captured["query_responses"] = args[1], result[0]
        return result

    def timed_forward(model, *args, **kwargs):
        if torch.is_grad_enabled() and marks["train_first"] is None:
            marks["train_first"] = time.perf_counter()
        return real_forward(model, *args, **kwargs)

    mod.batch_generation, mod.forward = timed_generation, timed_forward
    args = PPOConfig(
        output_dir=str(out.parent / "trl_out"), per_device_train_batch_size=spec["batch"], gradient_accumulation_steps=1,
        num_mini_batches=spec["batch"] // spec["mini_batch"], num_ppo_epochs=spec["epochs"],
        response_length=spec["response_length"], total_episodes=spec["batch"], local_rollout_forward_batch_size=spec["batch"],
        num_sample_generations=0, use_cpu=True, report_to=[], save_strategy="no", learning_rate=1e-5,
        seed=spec["seed"], stop_token=None, logging_steps=1000, bf16=False, fp16=False)
    dataset = Dataset.from_dict({"input_ids": spec["prompts"]})
    trainer = PPOTrainer(args=args, processing_class=tok, model=policy, ref_model=ref, reward_model=reward,
                         train_dataset=dataset, value_model=value)
    torch_optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate wraps it
    torch_optimizer.register_step_post_hook(lambda *_: marks.__setitem__("step_end", time.perf_counter()))
    started = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - started
    query_responses = captured["query_responses"]
    # the dataloader shuffles: return the prompts in the order TRL used them, left pads stripped
    queries = captured["queries"]
    prompts = [[t for t in row if t != tok.pad_token_id] for row in queries.tolist()]
    responses = query_responses[:, queries.shape[1]:].tolist()
    out.write_text(json.dumps({
        "trl_version": trl.__version__, "threads": torch.get_num_threads(), "prompts": prompts, "responses": responses,
        "generation_s": marks["gen_end"] - marks["gen_start"], "scoring_s": marks["train_first"] - marks["gen_end"],
        "training_s": marks["step_end"] - marks["train_first"], "total_s": total,
        "padded_tokens": int(query_responses.numel())}))


def trl_iteration_worker(spec: dict, out: Path) -> None:
    """Run ``iterations`` + 1 whole PPOTrainer updates (generation, reward/value/ref scoring, GAE, PPO
    epochs, TRL's own logging and bookkeeping); write when each one's generation started."""
    import torch
    from datasets import Dataset

    import trl
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as mod

    tok, policy, ref, reward, value = _trl_models(spec)
    starts: list[float] = []
    lengths: list[float] = []
    real_generation = mod.batch_generation

    def timed_generation(*args, **kwargs):
        starts.append(time.time())
        result = real_generation(*args, **kwargs)
        lengths.append(float(result[0].shape[1] - args[1].shape[1]))  # sampled width (padded after a stop)
        return result

    mod.batch_generation = timed_generation
    updates = spec["iterations"] + 1
    args = PPOConfig(
        output_dir=str(out.parent / "trl_out"), per_device_train_batch_size=spec["batch"], gradient_accumulation_steps=1,
        num_mini_batches=spec["batch"] // spec["mini_batch"], num_ppo_epochs=spec["epochs"],
        response_length=spec["response_length"], total_episodes=spec["batch"] * updates,
        local_rollout_forward_batch_size=spec["batch"], num_sample_generations=0, use_cpu=True, report_to=[],
        save_strategy="no", learning_rate=1e-5, seed=spec["seed"], stop_token="eos", logging_steps=1, bf16=False,
        fp16=False)
    trainer = PPOTrainer(args=args, processing_class=tok, model=policy, ref_model=ref, reward_model=reward,
                         train_dataset=Dataset.from_dict({"input_ids": spec["prompts"]}), value_model=value)
    called = time.time()
    trainer.train()
    ended = time.time()
    out.write_text(json.dumps({"trl_version": trl.__version__, "threads": torch.get_num_threads(),
                               "walls": [b - a for a, b in zip(starts, starts[1:])], "startup_s": starts[0] - called,
                               "last_s": ended - starts[-1], "response_width": lengths}))


# ----------------------------------------------------------------------------- our side (project venv)

def ours_worker(spec: dict, out: Path) -> None:
    """Score the same sequences into an advantages table and run one_update_trainer's update on it."""
    sys.path.insert(0, str(REPO))
    from rlhf_core.config import load_config
    from rlhf_core.data.schemas import ADVANTAGES
    from rlhf_core.io.atomic import atomic_write_parquet
    from rlhf_core.run.layout import RunDir
    from rlhf_core.stages.init_critic import run_init_critic
    from rlhf_core.training.synthetic import synthetic_advantages
    from rlhf_core.training.run_trainer import one_update_trainer

    pairs = list(zip(spec["prompts"], spec["responses"]))
    run = RunDir(out.parent / "ours_run")
    started = time.perf_counter()
    table = synthetic_advantages(spec["model_dir"], pairs=pairs, seed=spec["seed"])
    scoring = time.perf_counter() - started
    atomic_write_parquet(run.advantages(1), table, ADVANTAGES)
    cfg = load_config(str(REPO / "configs/demo.yaml"), [
        f"actor_rollout_ref.model.path={spec['model_dir']}", "actor_rollout_ref.model.warm_start.enable=false",
        f"data.train_batch_size={spec['batch']}", f"data.max_response_length={spec['response_length']}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={spec['mini_batch']}",
        f"actor_rollout_ref.actor.ppo_epochs={spec['epochs']}", f"trainer.seed={spec['seed']}",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={spec['token_budget']}", *spec["ours_overrides"]])
    run_init_critic(cfg, run)  # the run's initial critic (a stage of its own since the floor-plan change), not timed
    started = time.perf_counter()
    with one_update_trainer(cfg, run, 1) as trainer:
        metrics = trainer.update(cfg, 1, progress=False)
    metrics.update(scoring_s=scoring, total_s=time.perf_counter() - started)
    out.write_text(json.dumps(metrics))


def ours_iteration_worker(spec: dict, out: Path) -> None:
    """``iterations`` + 1 iterations of the real flow (flows.pipeline.rlhf_pipeline, every stage task,
    manifests, checkpoints, MLflow, Prefect) in a fresh RLHF_HOME; write each iteration's wall time."""
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_overhead import offline_env, run_flow
    from rlhf_core.run.layout import RunDir

    home = out.parent / f"ours_home_{os.getpid()}"
    home.mkdir()  # Prefect creates its database under PREFECT_HOME only when the parent exists
    offline_env(home)
    overrides = [f"actor_rollout_ref.model.path={spec['model_dir']}", "trainer.test_freq=-1",
                 "trainer.val_before_train=false", f"data.train_batch_size={spec['batch']}",
                 f"data.max_response_length={spec['response_length']}",
                 f"actor_rollout_ref.actor.ppo_mini_batch_size={spec['mini_batch']}",
                 f"actor_rollout_ref.actor.ppo_epochs={spec['epochs']}", *spec["ours_overrides"]]
    run_dir, called, ended, _ = run_flow(home, spec["iterations"] + 1, overrides)
    run = RunDir(run_dir)
    starts = [run.read_json(run.manifest_path(k))["rollout"]["started_at"] for k in range(1, spec["iterations"] + 2)]
    lengths = [run.read_json(run.iteration_metrics(k), {}).get("response_length/mean") for k in range(1, spec["iterations"] + 2)]
    out.write_text(json.dumps({"walls": [b - a for a, b in zip(starts, starts[1:])], "startup_s": starts[0] - called,
                               "last_s": ended - starts[-1], "response_length": lengths}))


# ----------------------------------------------------------------------------- driver

def ensure_trl_venv(venv: Path) -> Path:
    """The TRL venv's python, building the venv on first use; exits 2 with a message when it cannot."""
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import trl, sys; from trl.experimental.ppo import PPOTrainer; "
             f"sys.exit(trl.__version__ != '{TRL_VERSION}')"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    print(f"building the TRL venv at {venv} (torch 2.13.0 CPU, trl {TRL_VERSION}; a few minutes, needs the package index)")
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        for pins in PINS:
            subprocess.run([str(python), "-m", "pip", "install", "-q", *pins], check=True)
        subprocess.run(probe, check=True)
    except subprocess.CalledProcessError as exc:
        sys.exit(f"error: could not build the TRL virtual environment at {venv} ({exc}). It needs the package "
                 f"index (pip install torch==2.13.0, then trl=={TRL_VERSION}); check network access, or delete "
                 f"{venv} and retry.")
    return python


def arith_prompts(model_dir: Path, n: int, source: str = "data/arith/train.jsonl") -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = [json.loads(line) for line in (REPO / source).read_text().splitlines()[:n]]
    return [tok(tok.apply_chat_template([{"role": "user", "content": r["question"]}], add_generation_prompt=True,
                                        tokenize=False), add_special_tokens=False)["input_ids"] for r in rows]


def run_worker(python: str, role: str, spec: dict, work: Path, env: dict, script: str = __file__) -> dict:
    """Run ``script --worker role`` with ``python`` in a fresh process; its JSON result."""
    spec_path, out = work / f"{role}_spec.json", work / f"{role}.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run([python, script, "--worker", role, str(spec_path), str(out)], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"error: the {role} worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _seconds(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def report(spec: dict, trl_runs: dict[int, list[dict]], ours_runs: list[dict]) -> None:
    """Per-phase medians of each side and the ratio of update tokens/s against each TRL thread setting."""
    real = sum(len(p) for p in spec["prompts"]) + sum(len(r) for r in spec["responses"])
    first = next(iter(trl_runs.values()))[0]
    ours0 = ours_runs[0]
    print(f"{spec['batch']} sequences, {real} real tokens ({first['padded_tokens']} padded in TRL), "
          f"response length {spec['response_length']}, {spec['epochs']} PPO epoch(s), mini-batch {spec['mini_batch']}, "
          f"{len(ours_runs)} run(s) per side, medians shown")
    print(f"ours: {int(ours0['perf/threads_per_rank'])} thread(s) per model, critic and actor "
          f"{'at the same time' if ours0.get('perf/concurrent_critic_actor') else 'one after the other'}")
    ours_loops = [o["perf/update_seconds"] for o in ours_runs]
    ours_train = median(ours_loops)
    ours_tps = median([o["perf/tokens_per_s"] for o in ours_runs])
    print(f"ours: scoring (old/ref log-probs) {median([o['scoring_s'] for o in ours_runs]):.2f} s, setup (engines) "
          f"{median([o['perf/setup_seconds'] for o in ours_runs]):.2f} s, update loop {ours_train:.2f} s "
          f"(runs: {_seconds(ours_loops)}), checkpoint "
          f"{median([o['perf/checkpoint_seconds'] for o in ours_runs]):.2f} s; update tokens/s {ours_tps:.0f}")
    for threads, runs in trl_runs.items():
        trains = [r["training_s"] for r in runs]
        train = median(trains)
        tps = real * spec["epochs"] / train
        print(f"TRL {runs[0]['trl_version']} PPOTrainer, {runs[0]['threads']} thread(s): generation "
              f"{median([r['generation_s'] for r in runs]):.2f} s, scoring (logprobs/ref/values/reward/GAE) "
              f"{median([r['scoring_s'] for r in runs]):.2f} s, training {train:.2f} s "
              f"(runs: {_seconds(trains)}); update tokens/s {tps:.0f}; "
              f"ratio ours/TRL {ours_tps / tps:.2f}x (goal >= 1.5x)")


def report_iterations(spec: dict, trl_runs: dict[int, list[dict]], ours_runs: list[dict]) -> None:
    """Mean seconds per whole iteration of each side (per run, then the median over runs) and the ratio."""
    def per_run(runs: list[dict], steady: bool) -> list[float]:
        return [mean(r["walls"][1:] if steady and len(r["walls"]) > 1 else r["walls"]) for r in runs]

    print(f"whole iterations: {spec['batch']} prompts, {spec['response_length']} response tokens at most, "
          f"{spec['epochs']} PPO epoch(s), mini-batch {spec['mini_batch']}; {spec['iterations']} iterations measured "
          f"per run ({spec['iterations'] + 1} run), {len(ours_runs)} run(s) per side, medians of the runs' means")
    lengths = [x for r in ours_runs for x in r["response_length"] if x is not None]
    ours, ours_steady = median(per_run(ours_runs, False)), median(per_run(ours_runs, True))
    print(f"ours (flows.pipeline.rlhf_pipeline, {' '.join(spec['ours_overrides']) or 'demo config'}): "
          f"{ours:.2f} s per iteration (runs: {_seconds(per_run(ours_runs, False))}; from iteration 2 on "
          f"{ours_steady:.2f} s); mean response length {mean(lengths):.1f}; start-up before iteration 1 "
          f"{median([r['startup_s'] for r in ours_runs]):.1f} s")
    print(f"  iterations (s): {' | '.join(_seconds(r['walls']) for r in ours_runs)}")
    for threads, runs in trl_runs.items():
        trl, trl_steady = median(per_run(runs, False)), median(per_run(runs, True))
        widths = [x for r in runs for x in r["response_width"]]
        print(f"TRL {runs[0]['trl_version']} PPOTrainer.train, {runs[0]['threads']} thread(s): {trl:.2f} s per "
              f"iteration (runs: {_seconds(per_run(runs, False))}; from iteration 2 on {trl_steady:.2f} s); "
              f"generated width {mean(widths):.1f}; train() → first generation "
              f"{median([r['startup_s'] for r in runs]):.1f} s (model loads before it)")
        print(f"  iterations (s): {' | '.join(_seconds(r['walls']) for r in runs)}")
        print(f"  ratio TRL/ours (ours' speed-up): {trl / ours:.2f}x (goal >= 1.5x; from iteration 2 on "
              f"{trl_steady / ours_steady:.2f}x)")


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=("iteration", "update"), default="iteration",
                        help="iteration: whole iterations, ours through the real flow; update: the PPO update alone")
    parser.add_argument("--iterations", type=positive_int, default=5, help="(iteration mode) iterations measured per run "
                        "(one more is run: its start ends the last measured one)")
    parser.add_argument("--batch", type=positive_int, default=64)
    parser.add_argument("--mini-batch", type=positive_int, default=32, help="prompts per optimizer step: it divides "
                        "--batch (TRL splits the batch into equal mini-batches)")
    parser.add_argument("--response-length", type=positive_int, default=32)
    parser.add_argument("--epochs", type=positive_int, help="PPO epochs (default: 1 in iteration mode, as the demo; 2 in update mode)")
    parser.add_argument("--hidden", type=tiny_hidden_size, default=64,
                        help="a multiple of 8: the tiny model's 4 attention heads, each of an even width")
    parser.add_argument("--layers", type=positive_int, default=2)
    parser.add_argument("--intermediate", type=positive_int, default=176)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--token-budget", type=positive_int, default=2048, help="our micro-batch token budget (the demo's 2048)")
    parser.add_argument("--ours-override", action="append", type=override, default=[], metavar="KEY=VALUE",
                        help="extra config override for our update (repeatable), e.g. data.use_sequence_packing=false")
    parser.add_argument("--trl-threads", type=nonnegative_int, nargs="+",
                        help="torch thread settings to run TRL at (0 = torch's own choice, all cores; default: 2 in "
                             "iteration mode, 1 and 0 in update mode); each is reported with its own ratio. Ours "
                             "picks its threads itself (1 per model of small matmuls, models.threads; the critic and the actor "
                             "at the same time on >= 2 cores)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="runs per side (interleaved); medians are reported")
    parser.add_argument("--venv", type=Path, default=Path(tempfile.gettempdir()) / "rlhf-bench-trl-venv")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        role, spec_path, out = args.worker
        WORKERS[role](json.loads(Path(spec_path).read_text()), Path(out))
        return
    if args.batch % args.mini_batch:  # also refuses a mini-batch larger than the batch
        parser.error(f"--mini-batch {args.mini_batch} must divide --batch {args.batch} (TRL splits the batch into "
                     "equal mini-batches; ours takes the same ones)")
    iteration_mode = args.mode == "iteration"
    args.epochs = args.epochs or (1 if iteration_mode else 2)
    args.trl_threads = args.trl_threads or ([2] if iteration_mode else [1, 0])

    trl_python = ensure_trl_venv(args.venv)
    sys.path.insert(0, str(REPO))
    from rlhf_core.models.tiny import TinyModelSpec, build_tiny_model

    with tempfile.TemporaryDirectory(prefix="rlhf-bench-trl-") as tmp:
        work = Path(tmp)
        env = dict(os.environ, RLHF_HOME=str(work / "home"), DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", DO_NOT_TRACK="1")
        model_dir = work / "model"
        build_tiny_model(model_dir, TinyModelSpec(hidden_size=args.hidden, num_hidden_layers=args.layers,
                                                  intermediate_size=args.intermediate, seed=args.seed))
        # iteration mode: the demo's prompt file (what our flow samples from), one batch per iteration for TRL
        prompts = (arith_prompts(model_dir, args.batch * (args.iterations + 1), "data/arith/demo.jsonl")
                   if iteration_mode else arith_prompts(model_dir, args.batch))
        spec = {"model_dir": str(model_dir), "prompts": prompts, "batch": args.batch, "iterations": args.iterations,
                "mini_batch": args.mini_batch, "response_length": args.response_length, "epochs": args.epochs,
                "seed": args.seed, "token_budget": args.token_budget, "ours_overrides": args.ours_override}
        trl_role, ours_role = ("trl_iteration", "ours_iteration") if iteration_mode else ("trl", "ours")
        trl_runs: dict[int, list[dict]] = {t: [] for t in args.trl_threads}
        ours_runs: list[dict] = []
        for repeat in range(args.repeats):
            for threads in args.trl_threads:
                result = run_worker(str(trl_python), trl_role, {**spec, "trl_threads": threads}, work, env)
                trl_runs[threads].append(result)
                if not iteration_mode and "responses" not in spec:  # seeded: every TRL run samples the same responses
                    spec["prompts"], spec["responses"] = result["prompts"], result["responses"]
            ours_runs.append(run_worker(sys.executable, ours_role, spec, work, env))
            print(f"run {repeat + 1}/{args.repeats} done (load average {os.getloadavg()[0]:.1f})", file=sys.stderr)
    (report_iterations if iteration_mode else report)(spec, trl_runs, ours_runs)


WORKERS = {"trl": trl_worker, "ours": ours_worker, "trl_iteration": trl_iteration_worker,
           "ours_iteration": ours_iteration_worker}


if __name__ == "__main__":
    main()
