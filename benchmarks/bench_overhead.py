"""Time per iteration outside stage compute in the real pipeline flow, by source: the demo's
orchestration overhead share (goal, issue 8: <= 5 %), and at a real model's layer shape the fixed cost
of the design before issue 15 against the resident design (goal: >= 10x less, < 1 s an iteration at
save_freq 10).

    python benchmarks/bench_overhead.py [--iterations 5] [--keep DIR] [--json FILE] [override ...]
    python benchmarks/bench_overhead.py --shape qwen2.5-0.5b --layers 8 --design both --save-freq 1 10 \
        [--iterations 3] [--validate]

Each measured run is a fresh process (its own temporary Prefect server, settings and heap) in a
fresh RLHF_HOME. ``--design`` sets trainer.resident_models (legacy = false: every stage loads its
models from disk, every iteration writes a full checkpoint; resident = true); ``both`` runs the two
one after the other, for every ``--save-freq`` value, and ends with one comparison table and the
ratio legacy/resident.

``--shape`` (benchmarks/shapes.py): a Qwen2 model of that shape cut to ``--layers`` layers with random
weights and the tiny tokenizer (qwen2.5-0.5b at 8 layers: 120 M parameters), built once under
``--model-cache``; the batch is tiny (8 prompts × 16 response tokens, one PPO epoch, one mini-batch;
validation off unless ``--validate``), so what is left is the fixed cost that grows with the
parameter count.

Runs ``flows.pipeline.rlhf_pipeline`` on configs/demo.yaml (without --shape: the full demo batch, 64
prompts, 32-token responses, the demo's own validation, learning-curve and checkpoint schedule)
without the SFT warm start, ``--iterations`` + 1 iterations, with its own SQLite MLflow store and
``rlhf_core.io.timing`` span logging on.

Definition, per iteration k:
  wall_k     = rollout.started_at(k+1) - rollout.started_at(k)   (everything the flow did for k:
               finish-iteration tasks, validation when due, transactions, MLflow, Prefect)
  compute_k  = sum over k's stage bodies (rollout, score, gae, update, guard, validate) of
               ``seconds - io_seconds`` from iter_k/manifest.json: the body's wall time minus the
               model/tokenizer loads, checkpoint writes, the update's setup (process group, model
               loads, DeepSpeed engines, optimizer state), table/JSON reads and writes, hashing and
               memory release it spent inside (``rlhf_core.io.timing``)
  overhead_k = 1 - compute_k / wall_k
The last iteration has no successor, so it only serves as the end mark of the one before.

The overhead is split by source (they add up to wall - compute): the Prefect task-run wrapper
(task-run time as the Prefect server recorded it minus the task function's own time), flow code
outside any task run (including Prefect's task submission), finish-iteration bodies (MLflow,
artifacts, learning curve, rest), the stage tasks' own reporting (MLflow, Prefect artifacts, rest),
the manifest bookkeeping around each stage body (input/output hashing, manifest reads and writes),
and the stage bodies' I/O by kind. Work of the flow's background reporter (an iteration's MLflow
batch, learning curve and Prefect artifacts, published while the next iteration runs) is not on
the path: it is shown apart, and shows in the overhead only as far as it slows the stages down. Start-up (Prefect server, MLflow run, preprocess, pack, the
iteration-0 validation) is reported apart.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from arguments import output_dir, output_file, override, positive_int
from shapes import SHAPES, build_shape_model, parameter_count

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
STAGES = ("rollout", "score", "gae", "update", "guard", "validate")
BODY_IO = (("model_load", "model/tokenizer loads"), ("checkpoint_write", "checkpoint writes"),
           ("update_setup", "update setup (engines, model + optimizer loads)"),
           ("table_read", "table reads"), ("table_write", "table writes"), ("json_write", "JSON writes"),
           ("manifest", "manifest reads/writes"), ("hashing", "hashing (weight fingerprints)"),
           ("memory_release", "memory release (gc.collect)"), ("gc_pause", "automatic full GC pauses"),
           ("process_launch", "rank process start-up"),
           ("state_snapshot", "in-memory state snapshots (rollback point, a save's capture)"),
           ("state_replay", "state replay (rebuilding a state that was only in memory)"))
REPORTING = (("mlflow", "MLflow"), ("prefect_artifact", "Prefect artifacts"), ("plot", "learning-curve PNG"))


def offline_env(home: Path) -> None:
    for key, value in {
        "RLHF_HOME": str(home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
        "DO_NOT_TRACK": "1", "MLFLOW_DISABLE_TELEMETRY": "true", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90", "DS_ACCELERATOR": "cpu",
        "PREFECT_HOME": str(home / "prefect"),
    }.items():
        os.environ[key] = value


def run_flow(home: Path, iterations: int, extra: list[str]) -> tuple[Path, float, float, list]:
    """Run the flow; returns (run dir, wall-clock time of the call's start, its end, its Prefect task runs)."""
    from flows.pipeline import PipelineParams, rlhf_pipeline
    from rlhf_core.io import timing

    overrides = [f"trainer.runs_root={home / 'runs'}", "actor_rollout_ref.model.warm_start.enable=false",
                 f"trainer.total_iterations={iterations}", *extra]
    timing.keep_spans()
    started = time.time()
    state = rlhf_pipeline(PipelineParams(config=str(REPO / "configs/demo.yaml"), overrides=overrides,
                                         run_name="overhead"), return_state=True)
    ended = time.time()
    summary = state.result()
    return Path(summary["run_dir"]), started, ended, task_runs(state.state_details.flow_run_id)


def task_runs(flow_run_id) -> list[tuple[str, float, float]]:
    """(name without its iteration suffix, start, end) of the flow run's task runs, as Prefect recorded them."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    time.sleep(2)  # task-run states reach the server as events, a moment after the flow returns
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return [(re.sub(r"-iter\d+$", "", r.name), r.start_time.timestamp(), r.end_time.timestamp())
            for r in runs if r.start_time and r.end_time]


def clipped(start: float, end: float, window: tuple[float, float]) -> float:
    return max(0.0, min(end, window[1]) - max(start, window[0]))


def covered(intervals: list[tuple[float, float]], window: tuple[float, float]) -> float:
    """Seconds of ``window`` covered by the union of ``intervals``."""
    total, cursor = 0.0, window[0]
    for s, e in sorted((max(s, window[0]), min(e, window[1])) for s, e in intervals):
        s = max(s, cursor)
        if e > s:
            total, cursor = total + e - s, e
    return total


def inside(span, containers) -> bool:
    return any(c.start <= span.start and span.end <= c.end for c in containers)


def account(k: int, m: dict, window: tuple[float, float], runs: list, spans: list) -> dict:
    """Iteration k's wall time split into compute and every overhead source (see the docstring)."""
    wall = window[1] - window[0]
    bodies = {s: m[s] for s in STAGES if s in m and m[s].get("started_at", 0) >= window[0] - 1e-6
              and m[s].get("finished_at", 0) <= window[1] + 1e-6}
    row: dict = {"k": k, "wall": wall, "stage_seconds": {s: float(r["seconds"]) for s, r in bodies.items()},
                 "stage_io": {s: float(r.get("io_seconds", 0.0)) for s, r in bodies.items()}}
    row["compute"] = sum(row["stage_seconds"].values()) - sum(row["stage_io"].values())
    io: dict[str, float] = {}
    for rec in bodies.values():
        for kind, sec in (rec.get("io") or {}).items():
            io[kind] = io.get(kind, 0.0) + sec
    background = [sp for sp in spans if getattr(sp, "background", False)]
    row["background"] = sum(clipped(sp.start, sp.end, window) for sp in background)
    spans = [sp for sp in spans if not getattr(sp, "background", False)]  # overlaps the path, not on it
    tasks = [sp for sp in spans if sp.kind.startswith("task:") and clipped(sp.start, sp.end, window) > 0]
    stage_calls = [sp for sp in spans if sp.kind == "stage_call" and clipped(sp.start, sp.end, window) > 0]
    leaves = [sp for sp in spans if not sp.in_stage and ":" not in sp.kind and sp.kind != "stage_call"
              and clipped(sp.start, sp.end, window) > 0]
    bookkeeping = sum(clipped(sp.start, sp.end, window) for sp in stage_calls) - sum(row["stage_seconds"].values())
    task_fn = sum(clipped(sp.start, sp.end, window) for sp in tasks)
    task_run_time = sum(clipped(s, e, window) for _, s, e in runs)
    sources: dict[str, float] = {
        "Prefect task-run wrapper": task_run_time - task_fn,
        "flow code outside task runs (incl. task submission)": wall - covered([(s, e) for _, s, e in runs], window),
    }
    for label, kinds in (("finish-iteration, kl-breach", ("task:finish-iteration", "task:kl-breach")),
                         ("stage tasks' reporting", None)):
        own = [t for t in tasks if (t.kind in kinds if kinds else t.kind not in
                                    ("task:finish-iteration", "task:kl-breach"))]
        fn_time = sum(clipped(t.start, t.end, window) for t in own)
        if kinds is None:
            fn_time -= sum(clipped(sp.start, sp.end, window) for sp in stage_calls)
        parts = {}
        for kind, name in REPORTING + (("manifest", "manifest reads/writes"), ("gc_pause", "automatic full GC pauses")):
            parts[name] = sum(clipped(sp.start, sp.end, window) for sp in leaves
                              if sp.kind == kind and inside(sp, own) and not inside(sp, stage_calls))
        parts["rest (logging, metrics, pruning)"] = fn_time - sum(parts.values())
        for name, sec in parts.items():
            sources[f"{label}: {name}"] = sec
    gc_outside = sum(clipped(sp.start, sp.end, window) for sp in leaves if sp.kind == "gc_pause" and not inside(sp, tasks))
    sources["flow code outside task runs (incl. task submission)"] -= gc_outside
    sources["flow code: automatic full GC pauses"] = gc_outside
    sources["stage bookkeeping: input/output hashing, manifest, skip check"] = bookkeeping
    for kind, name in BODY_IO:
        sources[f"stage bodies: {name}"] = io.pop(kind, 0.0)
    for kind, sec in io.items():
        sources[f"stage bodies: {kind}"] = sec
    row["sources"] = sources
    row["overhead"] = wall - row["compute"]
    row["unattributed"] = row["overhead"] - sum(sources.values())
    row["share"] = row["overhead"] / wall
    return row


def startup(run_dir: Path, called: float, first_iteration: dict) -> dict:
    setup = json.loads((run_dir / "manifest.json").read_text())
    pre, pack = setup["preprocess"], setup["pack"]
    return {"flow call → preprocess": pre["started_at"] - called, "preprocess + pack": pack["finished_at"] - pre["started_at"],
            "pack → iteration 1 (incl. iteration-0 validation)": first_iteration["rollout"]["started_at"] - pack["finished_at"]}


def print_report(rows: list[dict], ended: float, called: float, start_costs: dict, tail_s: float) -> None:
    print(f"\nflow: {len(rows) + 1} iterations, {ended - called:.1f} s from call to return")
    print(f"{'iter':>4} {'wall s':>7} {'compute s':>9} " + " ".join(f"{s[:8]:>8}" for s in STAGES) + f" {'overhead':>8}")
    print(f"{'':>22}" + " ".join(f"{'(io)':>8}" for _ in STAGES))
    for r in rows:
        print(f"{r['k']:>4} {r['wall']:>7.2f} {r['compute']:>9.2f} "
              + " ".join(f"{r['stage_seconds'].get(s, 0.0):>8.2f}" for s in STAGES) + f" {r['share']:>8.1%}")
        print(f"{'':>22}" + " ".join(f"{r['stage_io'].get(s, 0.0):>8.2f}" for s in STAGES))
    n = len(rows)
    mean_wall = sum(r["wall"] for r in rows) / n
    print(f"mean overhead share: {sum(r['overhead'] for r in rows) / sum(r['wall'] for r in rows):.1%} of the summed "
          f"walls (per-iteration mean {sum(r['share'] for r in rows) / n:.1%}; goal <= 5%)")
    if n > 1:
        steady = rows[1:]
        print(f"from iteration 2 on: {sum(r['overhead'] for r in steady) / sum(r['wall'] for r in steady):.1%}")
    print(f"\nwhere the overhead goes, mean s per iteration (share of the mean wall {mean_wall:.2f} s):")
    for name in rows[0]["sources"]:
        sec = sum(r["sources"].get(name, 0.0) for r in rows) / n
        if abs(sec) >= 0.0005:
            print(f"  {name:<70} {sec:>7.3f}  {sec / mean_wall:>6.1%}")
    sec = sum(r["background"] for r in rows) / n
    print(f"  {'(not in the overhead: background reporter, overlapping the next iteration)':<70} {sec:>7.3f}  "
          f"{sec / mean_wall:>6.1%}")
    for label, key in (("overlapping task runs (counted twice above)", "unattributed"),
                       ("total overhead", "overhead"), ("compute", "compute")):
        sec = sum(r[key] for r in rows) / n
        print(f"  {label:<70} {sec:>7.3f}  {sec / mean_wall:>6.1%}")
    print("one-off start-up:")
    for name, sec in start_costs.items():
        print(f"  {name}: {sec:.2f} s")
    print(f"  after the last stage → flow return (finish-iteration, export, MLflow close, final save): {tail_s:.2f} s")


# ----------------------------------------------------------------------------- one measured flow run (worker)

def measure(home: Path, iterations: int, overrides: list[str], keep: Optional[Path]) -> dict:
    """Run the flow for ``iterations`` + 1 iterations in a fresh RLHF_HOME and account iterations 1..N."""
    offline_env(home)
    load_before = os.getloadavg()[0]
    run_dir, called, ended, runs = run_flow(home, iterations + 1, overrides)
    from rlhf_core.io import timing

    spans = timing.spans()
    manifests = {k: json.loads((run_dir / f"iter_{k}" / "manifest.json").read_text()) for k in range(1, iterations + 2)}
    rows = [account(k, manifests[k], (manifests[k]["rollout"]["started_at"], manifests[k + 1]["rollout"]["started_at"]),
                    runs, spans) for k in range(1, iterations + 1)]
    last = manifests[iterations + 1]
    tail_end = max(last[s]["finished_at"] for s in STAGES if s in last)
    if keep:
        shutil.copytree(run_dir, keep, dirs_exist_ok=True)
    return {"rows": rows, "called": called, "ended": ended, "start_costs": startup(run_dir, called, manifests[1]),
            "tail_s": ended - tail_end, "load": [load_before, os.getloadavg()[0]]}


# ----------------------------------------------------------------------------- designs side by side (driver)

DESIGNS = {"legacy": "false", "resident": "true"}
"""--design → trainer.resident_models (legacy: every stage loads from disk, a full checkpoint every iteration)."""
COMPUTE_FREE = (("model_load", "model loads"), ("checkpoint_write", "ckpt writes"), ("update_setup", "update setup"),
                ("hashing", "hashing"), (("table_read", "table_write", "json_write", "manifest"), "table/JSON I/O"),
                (("memory_release", "gc_pause"), "memory release"), ("process_launch", "process launch"),
                ("state_snapshot", "state snapshot"))
"""The columns of the comparison: the stage bodies' I/O tallies by kind (rlhf_core.io.timing), grouped."""


def shape_overrides(model_dir: Path, validate: bool) -> list[str]:
    """The tiny batch of the shape benchmark (issue 15): 8 prompts × 16 response tokens, one PPO epoch on
    one mini-batch; verl's default learning rates, so a random 120 M model's step stays far below the KL
    guard's threshold (a rollback would add an attempt's work to the iteration); validation off."""
    out = [f"actor_rollout_ref.model.path={model_dir}", "data.train_batch_size=8", "data.max_response_length=16",
           "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_epochs=1",
           "actor_rollout_ref.actor.optim.lr=1e-6", "critic.optim.lr=1e-5"]
    if not validate:
        out += ["trainer.test_freq=-1", "trainer.val_before_train=false"]
    return out


def io_by_column(row: dict) -> dict[str, float]:
    """One iteration's compute-free stage time in the comparison's columns, plus orchestration (the rest
    of wall − compute: Prefect, flow code, bookkeeping and reporting around the bodies)."""
    body = {name[len("stage bodies: "):]: sec for name, sec in row["sources"].items() if name.startswith("stage bodies: ")}
    labels = dict(BODY_IO)
    out = {}
    for kinds, column in COMPUTE_FREE:
        kinds = (kinds,) if isinstance(kinds, str) else kinds
        out[column] = sum(body.get(labels.get(k, k), 0.0) for k in kinds)
    out["other I/O"] = sum(body.values()) - sum(out.values())  # a kind a stage tallies that is not listed here
    out["orchestration"] = row["overhead"] - sum(body.values())
    return out


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summarize(result: dict) -> dict:
    """Means per iteration of one run: wall, compute, outside-compute seconds and share, by column."""
    rows = result["rows"]
    columns = [io_by_column(r) for r in rows]
    steady = rows[1:] or rows
    return {"wall": mean([r["wall"] for r in rows]), "compute": mean([r["compute"] for r in rows]),
            "outside": mean([r["overhead"] for r in rows]),
            "share": sum(r["overhead"] for r in rows) / sum(r["wall"] for r in rows),
            "outside_steady": mean([r["overhead"] for r in steady]),
            "columns": {c: mean([col[c] for col in columns]) for c in columns[0]}}


def tidy(seconds: float) -> float:
    """Rounding noise (a difference of sums) shown as 0.000, not -0.000."""
    return seconds if abs(seconds) >= 5e-4 else 0.0


def print_comparison(results: dict[tuple, dict]) -> None:
    """One line per (save_freq, design), then legacy/resident per save_freq."""
    print("\n=== time per iteration outside forward/backward/generate (mean over the measured iterations) ===")
    first = summarize(next(iter(results.values())))
    cols = list(first["columns"])
    print(f"{'save_freq':>9} {'design':>8} {'wall s':>7} {'compute':>7} {'outside':>7} {'share':>6} {'it2+':>6} | "
          + " ".join(f"{c[:13]:>13}" for c in cols) + " | load")
    summaries = {key: summarize(r) for key, r in results.items()}
    for (freq, design), sm in summaries.items():
        load = results[(freq, design)]["load"]
        print(f"{freq if freq is not None else 'preset':>9} {design:>8} {sm['wall']:>7.2f} {sm['compute']:>7.2f} "
              f"{sm['outside']:>7.2f} {sm['share']:>6.1%} {sm['outside_steady']:>6.2f} | "
              + " ".join(f"{tidy(sm['columns'][c]):>13.3f}" for c in cols)
              + f" | {load[0]:.1f}→{load[1]:.1f}")
    for freq in dict.fromkeys(f for f, _ in summaries):
        legacy, resident = summaries.get((freq, "legacy")), summaries.get((freq, "resident"))
        if legacy and resident:
            print(f"save_freq {freq if freq is not None else 'preset'}: legacy/resident outside-compute time "
                  f"{legacy['outside'] / resident['outside']:.2f}x (goal >= 10x; it2+ "
                  f"{legacy['outside_steady'] / resident['outside_steady']:.2f}x), wall "
                  f"{legacy['wall'] / resident['wall']:.2f}x")
    print("(outside = wall - compute: the stage bodies' I/O columns + orchestration; it2+ = from iteration 2 on; "
          "load = 1-min load average at the run's start → end: the machine is shared, expect noise)")


def run_worker(home: Path, iterations: int, overrides: list[str], keep: Optional[Path]) -> dict:
    """``measure`` in a fresh process: its own Prefect server, settings, heap and model memory."""
    with tempfile.TemporaryDirectory(prefix="rlhf-bench-overhead-io-") as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"home": str(home), "iterations": iterations, "overrides": overrides,
                                    "keep": str(keep) if keep else None}))
        proc = subprocess.run([sys.executable, __file__, "--worker", str(spec), str(out)])
        if proc.returncode != 0:
            sys.exit(f"error: the measured flow run failed (exit {proc.returncode}); its output is above")
        return json.loads(out.read_text())


def save_freq(text: str) -> int:
    """trainer.save_freq as the config takes it: every N >= 1 iterations, or -1 for the last-good one only."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1 and value != -1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (save every N iterations) or -1 (the last-good checkpoint "
                                         f"only), got {text}")
    return value


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=positive_int, help="iterations measured (one more is run); default 5 on the "
                        "demo (it validates and redraws its curve every 5th), 3 with --shape")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="a real model's layer shape, random weights, "
                        "the tiny batch (benchmarks/shapes.py); default: the demo's tiny model and batch")
    parser.add_argument("--layers", type=positive_int, default=8, help="layers of the --shape model")
    parser.add_argument("--validate", action="store_true", help="with --shape: keep the demo's validation")
    parser.add_argument("--save-freq", type=save_freq, nargs="+", help="trainer.save_freq values, one run each "
                        "(>= 1, or -1: the last-good checkpoint only; default: the preset's)")
    parser.add_argument("--design", choices=("legacy", "resident", "both"), default="resident",
                        help="trainer.resident_models=false|true; both: one run each, side by side")
    parser.add_argument("--model-cache", type=output_dir, default=REPO / ".rlhf" / "models" / "shapes",
                        help="where --shape models are built once and reused")
    parser.add_argument("--keep", type=output_dir, help="copy each run directory under here (<design>-sf<N>)")
    parser.add_argument("--json", type=output_file, help="write every run's per-iteration rows here")
    parser.add_argument("--worker", nargs=2, type=Path, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", type=override, help="extra dotted config overrides")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.worker:
        spec = json.loads(args.worker[0].read_text())
        result = measure(Path(spec["home"]), spec["iterations"], spec["overrides"],
                         Path(spec["keep"]) if spec["keep"] else None)
        args.worker[1].write_text(json.dumps(result))
        return
    base = list(args.overrides)
    if args.shape:
        model_dir = build_shape_model(args.model_cache, args.shape, args.layers)
        print(f"model: {model_dir} ({parameter_count(model_dir) / 1e6:.1f} M parameters per model)")
        base = shape_overrides(model_dir, args.validate) + base
    iterations = args.iterations or (3 if args.shape else 5)
    designs = ("legacy", "resident") if args.design == "both" else (args.design,)
    results: dict[tuple, dict] = {}
    for freq in args.save_freq or [None]:
        for design in designs:
            overrides = [*base, f"trainer.resident_models={DESIGNS[design]}"]
            if freq is not None:
                overrides.append(f"trainer.save_freq={freq}")
            label = f"{design}-sf{freq if freq is not None else 'preset'}"
            print(f"\n### {label}: {iterations} iterations measured ({iterations + 1} run)", flush=True)
            home = Path(tempfile.mkdtemp(prefix="rlhf-bench-overhead-"))
            try:
                result = run_worker(home, iterations, overrides, args.keep / label if args.keep else None)
            finally:
                shutil.rmtree(home, ignore_errors=True)
            results[(freq, design)] = result
            print_report(result["rows"], result["ended"], result["called"], result["start_costs"], result["tail_s"])
    if args.json:
        args.json.write_text(json.dumps({f"{d}-sf{f}": r for (f, d), r in results.items()}, indent=1))
    print_comparison(results)


if __name__ == "__main__":
    main()
