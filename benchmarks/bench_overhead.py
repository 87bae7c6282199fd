"""Orchestration overhead of the real pipeline flow: the share of each iteration's wall time spent
outside stage compute. Goal (issue 8): <= 5 % on the demo.

    python benchmarks/bench_overhead.py [--iterations 5] [--keep DIR]

Runs ``flows.pipeline.rlhf_pipeline`` on configs/demo.yaml (full demo batch: 64 prompts, 32-token
responses; the demo's own validation, learning-curve and checkpoint schedule) without the SFT warm
start, ``--iterations`` + 1 iterations, in a fresh RLHF_HOME (its own ephemeral Prefect server and
SQLite MLflow store), in this process with ``rlhf_core.io.timing`` span logging on.

Definition, per iteration k:
  wall_k     = rollout.started_at(k+1) - rollout.started_at(k)   (everything the flow did for k:
               begin/finish-iteration tasks, validation when due, transactions, MLflow, Prefect)
  compute_k  = sum over k's stage bodies (rollout, score, gae, update, guard, validate) of
               ``seconds - io_seconds`` from iter_k/manifest.json: the body's wall time minus the
               model/tokenizer loads, checkpoint writes, the update's setup (process group, model
               loads, DeepSpeed engines, optimizer state), table/JSON reads and writes, hashing and
               memory release it spent inside (``rlhf_core.io.timing``)
  overhead_k = 1 - compute_k / wall_k
The last iteration has no successor, so it only serves as the end mark of the one before.

The overhead is split by source (they add up to wall - compute): the Prefect task-run wrapper
(task-run time as the Prefect server recorded it minus the task function's own time), flow code
outside any task run (including Prefect's task submission), begin/finish-iteration bodies (MLflow,
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
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
STAGES = ("rollout", "score", "gae", "update", "guard", "validate")
BODY_IO = (("model_load", "model/tokenizer loads"), ("checkpoint_write", "checkpoint writes"),
           ("update_setup", "update setup (engines, model + optimizer loads)"),
           ("table_read", "table reads"), ("table_write", "table writes"), ("json_write", "JSON writes"),
           ("manifest", "manifest reads/writes"), ("hashing", "hashing (weight fingerprints)"),
           ("memory_release", "memory release (gc.collect)"), ("gc_pause", "automatic full GC pauses"),
           ("process_launch", "rank process start-up"))
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
    for label, kinds in (("begin/finish-iteration", ("task:begin-iteration", "task:finish-iteration", "task:kl-breach")),
                         ("stage tasks' reporting", None)):
        own = [t for t in tasks if (t.kind in kinds if kinds else t.kind not in
                                    ("task:begin-iteration", "task:finish-iteration", "task:kl-breach"))]
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


def print_report(rows: list[dict], ended: float, called: float, start_costs: dict, last: dict) -> None:
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
    tail_end = max(last[s]["finished_at"] for s in STAGES if s in last)
    print(f"  after the last stage → flow return (finish-iteration, export, MLflow close): {ended - tail_end:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=5,
                        help="iterations measured (one more is run); the demo validates and redraws its curve every 5th")
    parser.add_argument("--keep", type=Path, help="copy the run directory here")
    parser.add_argument("--json", type=Path, help="write the per-iteration rows here")
    parser.add_argument("overrides", nargs="*", help="extra dotted config overrides")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="rlhf-bench-overhead-"))
    try:
        offline_env(home)
        run_dir, called, ended, runs = run_flow(home, args.iterations + 1, args.overrides)
        from rlhf_core.io import timing

        spans = timing.spans()
        manifests = {k: json.loads((run_dir / f"iter_{k}" / "manifest.json").read_text())
                     for k in range(1, args.iterations + 2)}
        rows = [account(k, manifests[k], (manifests[k]["rollout"]["started_at"], manifests[k + 1]["rollout"]["started_at"]),
                        runs, spans) for k in range(1, args.iterations + 1)]
        start_costs = startup(run_dir, called, manifests[1])
        if args.keep:
            shutil.copytree(run_dir, args.keep, dirs_exist_ok=True)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print_report(rows, ended, called, start_costs, manifests[args.iterations + 1])


if __name__ == "__main__":
    main()
