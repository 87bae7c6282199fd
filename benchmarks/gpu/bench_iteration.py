"""Whole PPO iterations through the real flow and the real command line (`rlhf run`, its console path,
in this process so that its memory can be measured), at Qwen2.5-0.5B's layer shape with random
weights: seconds by stage, rollout tokens/s, the rollout's time outside generation (weight sync and
wake-up with the resident vLLM engine), update tokens/s and MFU, and each stage's peak memory
against the memory estimate (``rlhf_core.training.memory``).

    python benchmarks/gpu/bench_iteration.py [--layers 24] [--iterations 1] [--prompts 256]
        [--max-response 256] [--vocab 151936] [--rollout hf|vllm] [--out FILE] [key=value ...]
    python benchmarks/gpu/bench_iteration.py --dry-run            # CPU, 1 layer, 4 prompts (CI runs it)
    python benchmarks/gpu/bench_iteration.py --allow-cpu --layers 4 --prompts 32 --max-response 64 \
        actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048 critic.ppo_max_token_len_per_gpu=2048
                                                                  # the memory check on the CPU

Prompts have mixed, GSM8K-like lengths: each joins 1-4 of the embedded arithmetic problems
(data/arith/train.jsonl), so prompts run ~40-200 tokens in the chat template; responses stop at EOS
or ``--max-response`` (a random-weight model rarely samples EOS, so most run to the cap). The model is
``benchmarks/shapes.build_shape_model``: Qwen2.5-0.5B's hidden, heads, KV heads and intermediate
size, ``--layers`` layers, the tiny tokenizer, and ``--vocab`` rows of embedding and LM head (default
Qwen2.5's real 151,936: ids past the tokenizer's 512 are tokens without text). The flow runs
configs/demo.yaml with the overrides below, ``--iterations`` + 1 iterations, the first reported apart
(engines built, kernels compiled).

Memory, per stage (the largest value in the stage's window, over the measured iterations): on CUDA
torch's allocator peak (``max_memory_allocated``, read and reset every 50 ms by a thread: tensors
only, no CUDA context or allocator cache, which the estimate leaves out too); on the CPU the
process's resident set (VmRSS every 50 ms) less what it held before the flow (the libraries
imported), with tensors of 1 MiB and more each in a mapping of their own (``MMAP_THRESHOLD``: freed
memory leaves the resident set), and the update's own VmHWM peak (perf/peak_rss_gb). The estimate's phases are compared
with the stages that reach them: update ↔ update, scoring ↔ score. ``nvidia-smi``'s peak is printed
too (a vLLM engine runs in its own process, which torch's counters miss).

MFU = 6 × (actor + critic parameters) × update tokens/s / ``--peak-tflops`` (H200 dense bf16: 989).
Writes every number to ``--out`` (JSON) and prints the tables. Exits 2 with one line on stderr without
CUDA unless ``--allow-cpu`` (or ``--dry-run``), with ``--rollout vllm`` where vLLM cannot run, and for a bad
argument (a count below 1, a vocabulary below the tokenizer's 512, an override without ``=``, an
``--out`` or ``--markdown`` in a directory that does not exist) before anything is built.
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
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from arguments import at_least, nonnegative_int, output_file, override, positive_float, positive_int  # noqa: E402
from bench_overhead import offline_env  # noqa: E402
from shapes import TOKENIZER_VOCAB, build_shape_model, parameter_count  # noqa: E402

STAGES = ("rollout", "score", "gae", "update", "guard", "validate")
GIB = 2 ** 30
QWEN25_VOCAB = 151936
"""Qwen2.5's vocabulary: embedding and LM head rows of the real model."""
PHASE_STAGE = {"update": "update", "scoring": "score", "rollout": "rollout"}
"""Which stage reaches each phase of the memory estimate."""
DRY_RUN = dict(layers=1, prompts=4, max_response=8, iterations=0, vocab=1024, allow_cpu=True, rollout="hf")
"""The CI's dry run: every step at a tiny shape on the CPU, ids past the tokenizer's included."""


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
    """Peak ``nvidia-smi`` memory.used (MiB, the largest GPU) while open; 0 without nvidia-smi."""

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


def vm_rss() -> int:
    """This process's resident set, bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class PeakSampler:
    """This process's memory in intervals of ``every_s``, to be split by stage afterwards
    (``peak``): on CUDA torch's allocator peak of each interval (read, then reset), else the
    resident set at its end. VmHWM is left alone: the update resets it for perf/peak_rss_gb."""

    def __init__(self, cuda: bool, every_s: float = 0.05):
        self.cuda, self.every_s, self._stop = cuda, every_s, threading.Event()
        self.samples: list[tuple[float, float, int]] = []
        """(start, end, bytes) per interval."""
        self._thread = threading.Thread(target=self._run, name="peak-sampler", daemon=True)

    def _read(self) -> int:
        import torch

        if not self.cuda:
            return vm_rss()
        if not torch.cuda.is_initialized():  # the flow has not touched the GPU yet
            return 0
        peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        return peak

    def _run(self) -> None:
        last = time.time()
        while not self._stop.wait(self.every_s):
            now = time.time()
            self.samples.append((last, now, self._read()))
            last = now

    def peak(self, start: float, end: float) -> int:
        """The largest value of the intervals that overlap [start, end]."""
        return max((b for s, e, b in self.samples if e >= start and s <= end), default=0)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def overrides(args, model_dir: Path, data: Path, home: Path) -> list[str]:
    return [f"actor_rollout_ref.model.path={model_dir}", f"data.train_files=[{data}]", "data.val_fraction=0.0",
            f"trainer.runs_root={home / 'runs'}", "actor_rollout_ref.model.warm_start.enable=false",
            f"data.train_batch_size={args.prompts}", f"data.max_response_length={args.max_response}",
            "data.max_prompt_length=512", f"actor_rollout_ref.actor.ppo_mini_batch_size={max(1, args.prompts // 2)}",
            f"actor_rollout_ref.rollout.name={args.rollout}", "actor_rollout_ref.rollout.generation_batch_tokens=65536",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384", "critic.ppo_max_token_len_per_gpu=16384",
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=32768",
            "actor_rollout_ref.actor.optim.lr=1e-6", "critic.optim.lr=1e-5", "trainer.test_freq=-1",
            "trainer.val_before_train=false", "trainer.kl_rollback_threshold=10", *args.override]


def run_rlhf(argv: list[str]) -> int:
    """`rlhf ARGV` as the console script runs it (its signal handling, its temporary Prefect server
    and the watch on it), in this process."""
    from rlhf_cli.main import main

    saved, sys.argv = sys.argv, ["rlhf", *argv]
    try:
        return main()
    finally:
        sys.argv = saved


def iteration_rows(run_dir: Path, iterations: int, params: int, peak_tflops: float,
                   memory: PeakSampler, base: int) -> list[dict]:
    rows = []
    for k in range(1, iterations + 2):
        manifest = json.loads((run_dir / f"iter_{k}" / "manifest.json").read_text())
        seconds = {s: manifest[s]["seconds"] for s in STAGES if s in manifest}
        peaks = {s: max(0, memory.peak(manifest[s]["started_at"], manifest[s]["finished_at"]) - base)
                 for s in STAGES if s in manifest}
        rollout, update = manifest["rollout"].get("metrics", {}), manifest["update"].get("metrics", {})
        tokens_per_s = float(update.get("perf/tokens_per_s", 0.0))
        rows.append({
            "iteration": k, "seconds": seconds, "wall_s": sum(seconds.values()), "peak_bytes": peaks,
            "rollout_tokens_per_s": rollout.get("perf/rollout_tokens_per_s"),
            "rollout_outside_generation_s": seconds["rollout"] - float(rollout.get("perf/rollout_seconds", 0.0)),
            "update_tokens_per_s": tokens_per_s, "update_peak_rss_gb": update.get("perf/peak_rss_gb"),
            "update_mfu": 6 * 2 * params * tokens_per_s / (peak_tflops * 1e12),
            "response_length_mean": rollout.get("response_length/mean"),
        })
    return rows


def memory_estimate(overrides_: list[str], model_dir: Path, device: str) -> dict:
    """The estimate's bytes per phase for this run (one rank, the flow's resident trainer), and its terms."""
    from rlhf_core.config import load_config
    from rlhf_core.training.memory import ModelShape, Shapes, capacity, estimate, memory_settings
    from rlhf_core.training.run_trainer import resident_possible

    cfg = load_config(str(REPO / "configs/demo.yaml"), overrides_)
    shape = ModelShape.read(model_dir)  # actor, critic backbone and reference are the one model
    est = estimate(memory_settings(cfg, 1), Shapes(shape, shape, shape), device=device,
                   device_memory=capacity(device), resident=resident_possible(cfg) is None)
    return {"phases": {p: est.device_bytes(p) + (est.host_bytes(p) if device == "cpu" else 0) for p in est.phases},
            "table": est.table()}


def memory_rows(estimated: dict, rows: list[dict]) -> list[dict]:
    """Per phase: the estimate against the peak of its stage over the measured iterations."""
    measured = rows[1:] or rows
    out = []
    for phase, bytes_ in estimated["phases"].items():
        stage = PHASE_STAGE[phase]
        peak = max((r["peak_bytes"].get(stage, 0) for r in measured), default=0)
        out.append({"phase": phase, "stage": stage, "estimate_bytes": bytes_, "measured_bytes": peak,
                    "estimate_over_measured": bytes_ / peak if peak else None})
    return out


VERL_QUICKSTART_STEP_S = 68.0
"""Seconds per training step in verl's published quickstart run (PPO on GSM8K, Qwen2.5-0.5B-Instruct,
256 prompts a step, vLLM rollout, one GPU): the figure the issue tracker compares against."""


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=positive_int, default=24, help="Qwen2.5-0.5B has 24")
    p.add_argument("--iterations", type=nonnegative_int, default=1, help="iterations measured (one more runs first)")
    p.add_argument("--prompts", type=positive_int, default=256)
    p.add_argument("--max-response", type=positive_int, default=256)
    p.add_argument("--vocab", type=at_least(TOKENIZER_VOCAB), default=QWEN25_VOCAB,
                   help=f"embedding and LM head rows (tokenizer: {TOKENIZER_VOCAB})")
    p.add_argument("--rollout", choices=("vllm", "hf"), default="hf")
    p.add_argument("--peak-tflops", type=positive_float, default=989.0)
    p.add_argument("--allow-cpu", action="store_true", help="run on a machine without CUDA (fp32 there)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shape: the whole path in about a minute")
    p.add_argument("--out", type=output_file, default=Path(tempfile.gettempdir()) / "bench_iteration.json")
    p.add_argument("--markdown", type=output_file, help="also append the tables to this Markdown file")
    p.add_argument("override", nargs="*", type=override, help="extra dotted config overrides")
    args = p.parse_args(argv)
    if args.dry_run:
        vars(args).update(DRY_RUN)
    return args


MMAP_THRESHOLD = "MALLOC_MMAP_THRESHOLD_"
"""glibc: allocations from this many bytes up get their own mapping, returned to the system when
freed. Fixed (instead of glibc's threshold that rises after each free) on the CPU, so a stage's
freed tensors leave the resident set and each stage's peak is its own, not the largest before it."""


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    import torch

    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.allow_cpu:  # nothing to measure: this script is the GPU check
        print("bench_iteration: this machine has no CUDA device; pass --allow-cpu to measure on the CPU, or "
              "--dry-run", file=sys.stderr)
        sys.exit(2)
    if not cuda and MMAP_THRESHOLD not in os.environ and argv is None:  # read by glibc at start: start again
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, MMAP_THRESHOLD: str(1 << 20)})
    if args.rollout == "vllm":  # after the re-start above: vLLM is imported once, by the process that runs
        from rlhf_core.rollout.vllm_engine import vllm_unavailable_reason

        reason = vllm_unavailable_reason()
        if reason:
            print(f"bench_iteration: --rollout vllm cannot run here: {reason}", file=sys.stderr)
            sys.exit(2)
    home = Path(tempfile.mkdtemp(prefix="rlhf-bench-iteration-"))
    offline_env(home)
    os.environ.pop("PREFECT_API_URL", None)  # rlhf's own temporary server, as a user's first run gets
    if cuda:
        os.environ.pop("DS_ACCELERATOR", None)  # offline_env pins DeepSpeed to the CPU for the CPU benchmarks
    device = "cuda" if cuda else "cpu"
    model_dir = build_shape_model(home / "models", "qwen2.5-0.5b", args.layers, vocab=args.vocab)
    data = gsm8k_like_prompts(home / "prompts.jsonl", args.prompts * (args.iterations + 1))
    flags = overrides(args, model_dir, data, home) + ([] if cuda else ["trainer.device=cpu"])
    estimated = memory_estimate(flags, model_dir, device)
    import deepspeed, mlflow, transformers  # noqa: E401,F401  imported before the baseline: not the run's memory
    import flows.pipeline  # noqa: F401

    base = 0 if cuda else vm_rss()
    started = time.time()
    with GpuMemorySampler() as gpu, PeakSampler(cuda) as memory:
        code = run_rlhf(["run", "-c", str(REPO / "configs/demo.yaml"), *flags,
                         "--iterations", str(args.iterations + 1), "--run-name", "bench"])
    if code != 0:
        sys.exit(f"bench_iteration: rlhf run exited with status {code}")
    run_dir = home / "runs" / "bench"
    params = parameter_count(model_dir)
    rows = iteration_rows(run_dir, args.iterations, params, args.peak_tflops, memory, base)
    mem = memory_rows(estimated, rows)
    result = {"device": device, "layers": args.layers, "vocab": args.vocab, "prompts": args.prompts,
              "max_response": args.max_response, "rollout": args.rollout, "parameters": params,
              "flow_s": time.time() - started, "peak_gpu_memory_mib": gpu.peak_mib, "baseline_rss_bytes": base,
              "iterations": rows, "memory": mem, "estimate_table": estimated["table"]}
    args.out.write_text(json.dumps(result, indent=2))
    report(args, result)
    if args.markdown:
        with args.markdown.open("a") as fh:
            fh.write(markdown(args, result))


def markdown(args, result: dict) -> str:
    """The run's tables in Markdown: seconds and peak memory by stage per iteration, rates, and the
    memory estimate against the measured peaks."""
    unit = "torch allocator peak" if result["device"] == "cuda" else "RSS over the baseline"
    lines = [f"\n### {args.layers} layers of Qwen2.5-0.5B, vocabulary {args.vocab} ({result['parameters'] / 1e6:.0f} M "
             f"parameters), {args.prompts} prompts, <= {args.max_response} response tokens, {args.rollout} rollout, "
             f"{result['device']}\n", "| iteration | " + " | ".join(STAGES) + " | wall s | rollout tok/s | update tok/s |",
             "|---" * (len(STAGES) + 4) + "|"]
    for r in result["iterations"]:
        lines.append(f"| {r['iteration']} | " + " | ".join(f"{r['seconds'].get(s, 0.0):.2f}" for s in STAGES)
                     + f" | {r['wall_s']:.2f} | {r['rollout_tokens_per_s'] or 0:.0f} | {r['update_tokens_per_s']:.0f} |")
    lines += [f"\nPeak memory by stage, GiB ({unit}):\n", "| iteration | " + " | ".join(STAGES) + " |",
              "|---" * (len(STAGES) + 1) + "|"]
    for r in result["iterations"]:
        lines.append(f"| {r['iteration']} | " + " | ".join(f"{r['peak_bytes'].get(s, 0) / GIB:.2f}" for s in STAGES) + " |")
    lines += ["\n| phase | estimate GiB | stage | measured GiB | estimate / measured |", "|---|---|---|---|---|"]
    for m in result["memory"]:
        ratio = f"{m['estimate_over_measured']:.2f}" if m["estimate_over_measured"] else "-"
        lines.append(f"| {m['phase']} | {m['estimate_bytes'] / GIB:.2f} | {m['stage']} | {m['measured_bytes'] / GIB:.2f} | {ratio} |")
    return "\n".join(lines) + "\n"


def report(args, result: dict) -> None:
    rows = result["iterations"]
    print(f"\n{args.layers} layers, vocabulary {args.vocab} ({result['parameters'] / 1e6:.0f} M parameters), "
          f"{args.prompts} prompts, responses <= {args.max_response} tokens, rollout {args.rollout} on "
          f"{result['device']}; nvidia-smi peak {result['peak_gpu_memory_mib']} MiB")
    print("iter  " + "".join(f"{s:>9}" for s in STAGES) + "   wall s  rollout tok/s  outside-gen s  update tok/s    MFU")
    for r in rows:
        cells = "".join(f"{r['seconds'].get(s, 0.0):9.2f}" for s in STAGES)
        print(f"{r['iteration']:>4}  {cells} {r['wall_s']:8.2f}  {r['rollout_tokens_per_s'] or 0:13.0f}  "
              f"{r['rollout_outside_generation_s']:13.2f}  {r['update_tokens_per_s']:12.0f}  {100 * r['update_mfu']:5.1f}%")
    print("peak GiB " + "".join(f"{s:>9}" for s in STAGES)
          + ("   (torch allocator)" if result["device"] == "cuda" else "   (RSS over the baseline)"))
    for r in rows:
        print(f"{r['iteration']:>8} " + "".join(f"{r['peak_bytes'].get(s, 0) / GIB:9.2f}" for s in STAGES))
    print("memory estimate against the measured peak (iterations after the first):")
    for m in result["memory"]:
        ratio = m["estimate_over_measured"]
        print(f"  {m['phase']:>8}: estimate {m['estimate_bytes'] / GIB:7.2f} GiB, {m['stage']} stage "
              f"{m['measured_bytes'] / GIB:7.2f} GiB" + (f", estimate/measured {ratio:.2f}" if ratio else ""))
    print(result["estimate_table"])
    print(f"(iteration 1 includes the engines' start-up; written to {args.out})")
    measured = sorted(r["wall_s"] for r in rows[1:]) or [rows[0]["wall_s"]]
    median = measured[len(measured) // 2]
    print(f"median iteration {median:.1f} s against verl's quickstart ~{VERL_QUICKSTART_STEP_S:.0f} s a step "
          f"(256 prompts, Qwen2.5-0.5B, vLLM, GSM8K prompts): {VERL_QUICKSTART_STEP_S / median:.2f}x")


if __name__ == "__main__":
    main()
