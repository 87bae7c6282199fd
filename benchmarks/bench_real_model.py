"""The costs of a real vocabulary (issue 48): a preset's whole run against a memory budget, where each
iteration's time goes against its floors, and the logits' memory in one pass.

    python benchmarks/bench_real_model.py run [--preset configs/smollm2-arith.yaml] [--budget-gb 12] [key=value ...]
    python benchmarks/bench_real_model.py logits [--model data/models/smollm2-135m-instruct] [--sequences 32]
                                                 [--prompt 100] [--response 500]

``run`` starts ``rlhf run -c PRESET`` (with the overrides; ``--iterations N`` passes through) as a user
does, samples the resident memory of its whole process tree (the flow, a vLLM engine, a rank or a
reward process it starts) every 0.5 s, and when it ends prints: the wall time and where it went
(start-up, warm start, the validations, the iterations), the peak tree RSS against ``--budget-gb``,
the median seconds of each stage against its floor (its model FLOPs at the measured matmul rate,
``rlhf status``'s report) and its share of the iteration, and the run's accuracy lines. The run's own
output goes to ``--log`` (default: beside the run directory's name, in the current directory).

``logits`` loads the model and scores ``--sequences`` responses of ``--response`` tokens after
``--prompt``-token prompts in ONE micro-batch (every budget raised to hold them) in a fresh process
per case, and prints the growth of the process's peak RSS over the loaded model's, for: the log-prob
pass (old / reference log-probs), the KL guard's exact pass, each with the LM head on row blocks
(``models.packed.HEAD_CHUNK_BYTES``, the default) and in one call (the block limit lifted), beside
what one fp32 copy of the responses' logits takes. Random token ids: the memory does not depend on them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from arguments import output_file, positive_float, positive_int  # noqa: E402

GIB = 1024 ** 3
STAGES = ("rollout", "score", "gae", "update", "guard", "validate")


# ---------------------------------------------------------------------------------------------
# run: a preset's whole run, its process tree's memory sampled
# ---------------------------------------------------------------------------------------------


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and every process below it (0 once it is gone)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total


class PeakSampler(threading.Thread):
    """Samples ``tree_rss(pid)`` every ``interval`` s; ``peak`` is the largest seen."""

    def __init__(self, pid: int, interval: float = 0.5):
        super().__init__(daemon=True)
        self.pid, self.interval, self.peak, self.done = pid, interval, 0, threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.interval):
            self.peak = max(self.peak, tree_rss(self.pid))


def run_preset(preset: str, overrides: list[str], log: Path) -> tuple[int, float, int, Path]:
    """(exit status, wall seconds, peak tree RSS bytes, run directory) of ``rlhf run -c preset``."""
    rlhf = Path(sys.executable).with_name("rlhf")
    command = [str(rlhf) if rlhf.is_file() else "rlhf", "run", "-c", preset, *overrides]
    print(f"running: {' '.join(command)}  (output: {log})", flush=True)
    started = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        sampler = PeakSampler(proc.pid)
        sampler.start()
        try:
            code = proc.wait()
        except KeyboardInterrupt:
            os.killpg(proc.pid, signal.SIGINT)
            code = proc.wait()
        sampler.done.set()
        sampler.join()
    seconds = time.perf_counter() - started
    found = re.search(r"^run directory: (.+)$", log.read_text(errors="replace"), re.M)
    return code, seconds, sampler.peak, Path(found.group(1)) if found else Path()


def stage_table(run_dir: Path) -> list[dict]:
    """Per stage: median seconds over the iterations that ran it, its floor, x floor, share of the
    iteration (the median iteration's stage seconds summed)."""
    from rlhf_core.control.query import read_iteration_metrics
    from rlhf_core.run.layout import RunDir

    run = RunDir(run_dir)
    by_stage: dict[str, list[tuple[float, float]]] = {s: [] for s in STAGES}
    for k in run.iterations():
        if k < 1:
            continue
        m = read_iteration_metrics(run, k)
        for stage in STAGES:
            seconds = m.get(f"perf/stage_seconds/{stage}")
            if seconds is not None:
                by_stage[stage].append((seconds, m.get(f"perf/stage_floor_seconds/{stage}") or float("nan")))
    rows = []
    for stage, values in by_stage.items():
        if values:
            seconds = statistics.median(v[0] for v in values)
            floors = [v[1] for v in values if v[1] == v[1]]
            rows.append({"stage": stage, "runs": len(values), "seconds": seconds,
                         "floor": statistics.median(floors) if floors else None})
    total = sum(r["seconds"] for r in rows if r["stage"] != "validate")
    for r in rows:
        r["share"] = r["seconds"] / total if r["stage"] != "validate" and total else None
    return rows


def phases(run_dir: Path) -> dict[str, float]:
    """Seconds of the setup stages and of iteration 0's validation, from their manifests."""
    from rlhf_core.run.layout import RunDir
    from rlhf_core.run.manifest import read_manifest

    run = RunDir(run_dir)
    setup = read_manifest(run, None)
    out = {stage: float(rec.get("seconds") or 0.0) for stage, rec in setup.items() if isinstance(rec, dict)}
    zero = read_manifest(run, 0).get("validate") or {}
    out["validate (iteration 0)"] = float(zero.get("seconds") or 0.0)
    return out


def cmd_run(args: argparse.Namespace) -> None:
    from rlhf_core.control.status import accuracy_lines
    from rlhf_core.run.layout import RunDir

    log = args.log or Path(f"bench-real-model-{time.strftime('%Y%m%d-%H%M%S')}.log")
    code, seconds, peak, run_dir = run_preset(args.preset, args.overrides, log)
    if code != 0 or not run_dir.is_dir():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        sys.exit(f"bench_real_model: rlhf run exited {code}; the end of {log}:\n{tail}")
    rows = stage_table(run_dir)
    print(f"\n{args.preset} {' '.join(args.overrides)}: {seconds / 60:.1f} min wall, run directory {run_dir}")
    print(f"peak RSS of the process tree: {peak / GIB:.2f} GiB (budget {args.budget_gb:g} GiB: "
          f"{'within' if peak <= args.budget_gb * GIB else 'OVER'})")
    print("setup and iteration 0: " + ", ".join(f"{k} {v:.0f} s" for k, v in phases(run_dir).items()))
    print(f"{'stage':<10}{'runs':>5}{'median s':>10}{'floor s':>9}{'x floor':>9}{'share':>8}")
    for r in rows:
        floor = f"{r['floor']:9.2f}{r['seconds'] / r['floor']:9.1f}" if r["floor"] else f"{'-':>9}{'-':>9}"
        share = f"{r['share']:8.0%}" if r["share"] is not None else f"{'-':>8}"
        print(f"{r['stage']:<10}{r['runs']:>5}{r['seconds']:>10.1f}{floor}{share}")
    for line in accuracy_lines(RunDir(run_dir)):
        print(line)
    if args.out:
        args.out.write_text(json.dumps({"preset": args.preset, "overrides": args.overrides, "seconds": seconds,
                                        "peak_rss_bytes": peak, "stages": rows, "phases": phases(run_dir),
                                        "run_dir": str(run_dir)}, indent=1))


# ---------------------------------------------------------------------------------------------
# logits: one pass's memory with the head on blocks and in one call
# ---------------------------------------------------------------------------------------------


def vm_hwm() -> int:
    """This process's peak resident bytes so far (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def reset_hwm() -> None:
    """Start a new peak window (Linux: 5 → /proc/self/clear_refs resets VmHWM)."""
    Path("/proc/self/clear_refs").write_text("5")


def logits_worker(model_dir: Path, case: str, blocks: bool, sequences: int, prompt: int, response: int,
                  out: Path) -> None:
    import torch

    from rlhf_core.models import packed
    from rlhf_core.scoring.logprobs import compute_token_logprobs
    from rlhf_core.scoring.policy_kl import token_kl
    from transformers import AutoModelForCausalLM

    if not blocks:
        packed.HEAD_CHUNK_BYTES = 1 << 62  # one head call, as before the blocks
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval() if case == "kl" else None
    vocab = model.config.vocab_size
    seqs = torch.randint(100, vocab, (sequences, prompt + response)).tolist()
    plens = [prompt] * sequences
    budget = sequences * (prompt + response)  # every sequence in one micro-batch
    reset_hwm()
    base = vm_hwm()
    started = time.perf_counter()
    with torch.no_grad():
        if case == "logprobs":
            compute_token_logprobs(model, seqs, plens, budget, progress=False)
        else:
            token_kl(model, ref, seqs, plens, budget=budget, temperature=1.0)
    out.write_text(json.dumps({"growth": vm_hwm() - base, "seconds": time.perf_counter() - started,
                               "logits_bytes": sequences * response * vocab * 4}))


def cmd_logits(args: argparse.Namespace) -> None:
    results = []
    with tempfile.TemporaryDirectory(prefix="rlhf-bench-logits-") as scratch:
        for case in ("logprobs", "kl"):
            for blocks in (True, False):
                out = Path(scratch) / f"{case}-{blocks}.json"
                proc = subprocess.run([sys.executable, __file__, "logits", "--model", str(args.model),
                                       "--sequences", str(args.sequences), "--prompt", str(args.prompt),
                                       "--response", str(args.response),
                                       "--worker", case, "blocks" if blocks else "whole", str(out)],
                                      capture_output=True, text=True)
                if proc.returncode != 0:
                    tail = "\n".join(proc.stderr.splitlines()[-8:])
                    results.append((case, blocks, None, f"failed (exit {proc.returncode}): {tail}"))
                    continue
                results.append((case, blocks, json.loads(out.read_text()), ""))
    print(f"{args.sequences} sequences x ({args.prompt} prompt + {args.response} response) tokens in one "
          f"micro-batch, {args.model.name}, fp32, no grad")
    print(f"{'pass':<30}{'LM head':<14}{'peak growth GiB':>16}{'x one logits copy':>19}{'seconds':>9}")
    for case, blocks, r, error in results:
        name = {"logprobs": "log-probs (score)", "kl": "exact KL (guard, two models)"}[case]
        head = "row blocks" if blocks else "one call"
        if r is None:
            print(f"{name:<30}{head:<14}{error}")
            continue
        print(f"{name:<30}{head:<14}{r['growth'] / GIB:>16.2f}{r['growth'] / r['logits_bytes']:>19.2f}"
              f"{r['seconds']:>9.1f}")
    if results and results[0][2]:
        print(f"one fp32 copy of the responses' logits: {results[0][2]['logits_bytes'] / GIB:.2f} GiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    run = sub.add_parser("run", help="a preset's whole run: memory, time by stage, accuracy")
    run.add_argument("--preset", default="configs/smollm2-arith.yaml")
    run.add_argument("--budget-gb", type=positive_float, default=12.0, help="the peak RSS the run must stay within")
    run.add_argument("--log", type=output_file, help="where the run's own output goes")
    run.add_argument("--out", type=output_file, help="also write the numbers here as JSON")
    logits = sub.add_parser("logits", help="one pass's memory with the LM head on row blocks and in one call")
    logits.add_argument("--model", type=Path, default=REPO / "data/models/smollm2-135m-instruct")
    logits.add_argument("--sequences", type=positive_int, default=32)
    logits.add_argument("--prompt", type=positive_int, default=100)
    logits.add_argument("--response", type=positive_int, default=500)
    logits.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.what == "run":
        if not Path(args.preset).is_file():
            parser.error(f"--preset {args.preset}: no such file")
        args.overrides = rest  # key=value overrides and rlhf run's own options (--iterations N)
        cmd_run(args)
        return
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there (SmolLM2: `make smollm2`)")
    if args.worker:
        case, how, out = args.worker
        logits_worker(args.model, case, how == "blocks", args.sequences, args.prompt, args.response, Path(out))
        return
    cmd_logits(args)


if __name__ == "__main__":
    main()
