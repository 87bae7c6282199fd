"""Orchestration overhead of the real pipeline flow: the share of each iteration's wall time spent
outside stage compute (Prefect task runs, MLflow logging, manifests, hashing, reporting). Goal: ≤ 5 %.

    python benchmarks/bench_overhead.py [--iterations 3] [--keep DIR]

Runs ``flows.pipeline.rlhf_pipeline`` on configs/demo.yaml (full demo batch: 64 prompts, 32-token
responses) without the SFT warm start, ``--iterations`` + 1 iterations, in a fresh RLHF_HOME (its own
ephemeral Prefect server and SQLite MLflow store). Validation is pushed past the run
(``trainer.test_freq``) so no iteration carries it.

Per iteration k (read from the manifests, ``iter_<k>/manifest.json``):
  wall_k    = rollout.started_at(k+1) − rollout.started_at(k)   (everything the flow did for k,
              including begin/finish-iteration tasks, transaction hooks and MLflow calls)
  compute_k = Σ stage ``seconds`` (rollout, score, gae, update, guard) — the stage bodies as
              ``execute_stage`` timed them, which includes their own model loads and checkpoint I/O
  overhead  = 1 − compute_k / wall_k
The last iteration has no successor, so it only serves as the end mark of the one before.
Start-up is reported apart: flow call → preprocess start (Prefect server start, MLflow run creation),
setup stages, and the iteration-0 validation between pack and iteration 1.
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
STAGES = ("rollout", "score", "gae", "update", "guard")


def offline_env(home: Path) -> None:
    for key, value in {
        "RLHF_HOME": str(home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
        "DO_NOT_TRACK": "1", "MLFLOW_DISABLE_TELEMETRY": "true", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90", "DS_ACCELERATOR": "cpu",
        "PREFECT_HOME": str(home / "prefect"),
    }.items():
        os.environ[key] = value


def run_flow(home: Path, iterations: int) -> tuple[Path, float, float, list, dict]:
    """Run the flow; returns (run dir, wall-clock time of the call's start, its end, its Prefect task
    runs, the finish-iteration breakdown)."""
    from flows.pipeline import PipelineParams, rlhf_pipeline

    overrides = [f"trainer.runs_root={home / 'runs'}", "actor_rollout_ref.model.warm_start.enable=false",
                 "trainer.test_freq=1000", f"trainer.total_iterations={iterations}"]
    started = time.time()
    state = rlhf_pipeline(PipelineParams(config=str(REPO / "configs/demo.yaml"), overrides=overrides,
                                         run_name="overhead"), return_state=True)
    ended = time.time()
    summary = state.result()
    run_dir = Path(summary["run_dir"])
    try:
        parts = finish_parts(run_dir, summary["mlflow_run_id"], iterations)
    except Exception as exc:  # a diagnostic only: never lose the main numbers to it
        parts = {f"(breakdown failed: {type(exc).__name__}: {exc})": float("nan")}
    return run_dir, started, ended, task_runs(state.state_details.flow_run_id), parts


def task_runs(flow_run_id) -> list[tuple[str, float, float]]:
    """(name without its iteration suffix, start, end) of the flow run's task runs, as Prefect recorded them."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    time.sleep(2)  # task-run states reach the server as events, a moment after the flow returns
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return [(re.sub(r"-iter\d+$", "", r.name), r.start_time.timestamp(), r.end_time.timestamp())
            for r in runs if r.start_time and r.end_time]


def task_breakdown(runs: list, window: tuple[float, float], n_iterations: int) -> list[tuple[str, float]]:
    """Mean seconds per iteration of each Prefect task inside the measured window, plus the time no
    task covered (flow-level code: transactions, the tqdm table, Prefect task submission)."""
    per_task: dict[str, float] = {}
    inside = [(n, max(s, window[0]), min(e, window[1])) for n, s, e in runs if e > window[0] and s < window[1]]
    for name, s, e in inside:
        per_task[name] = per_task.get(name, 0.0) + (e - s)
    covered, cursor = 0.0, window[0]
    for _, s, e in sorted(inside, key=lambda r: r[1]):
        s = max(s, cursor)
        if e > s:
            covered, cursor = covered + e - s, e
    rows = sorted(((n, t / n_iterations) for n, t in per_task.items()), key=lambda r: -r[1])
    return rows + [("(outside any task)", (window[1] - window[0] - covered) / n_iterations)]


def iteration_rows(run_dir: Path, iterations: int) -> list[dict]:
    manifests = {k: json.loads((run_dir / f"iter_{k}" / "manifest.json").read_text()) for k in range(1, iterations + 1)}
    rows = []
    for k in range(1, iterations):
        m, nxt = manifests[k], manifests[k + 1]
        wall = nxt["rollout"]["started_at"] - m["rollout"]["started_at"]
        stage_s = {s: float(m[s]["seconds"]) for s in STAGES if s in m}
        compute = sum(stage_s.values())
        last_end = max(m[s]["finished_at"] for s in stage_s)
        rows.append({"k": k, "wall": wall, "compute": compute, "share": 1 - compute / wall,
                     "after_guard": nxt["rollout"]["started_at"] - last_end, **stage_s})
    return rows


def finish_parts(run_dir: Path, mlflow_run_id: str, k: int) -> dict[str, float]:
    """Seconds of each part of the finish-iteration task, re-run once on iteration k of the finished run
    (modules already imported, so this is the steady per-iteration cost). Outside a flow: the Prefect
    artifact calls go to the same server."""
    from rlhf_core.io.rundir import RunDir
    from rlhf_core.pipeline import iteration_metrics, resolve_run_config
    from tasks import reporting, tracking
    from tasks.iteration import derived_only

    run = RunDir(run_dir)
    cfg = resolve_run_config(run.root, None, [])
    parts, t = {}, time.perf_counter()

    def mark(name: str) -> None:
        nonlocal t
        parts[name], t = time.perf_counter() - t, time.perf_counter()

    metrics = iteration_metrics(cfg, run, k); mark("iteration_metrics (read manifests + metrics)")
    png = reporting.plot_learning_curve(run, run.root / "plots" / "bench.png",
                                        kl_threshold=cfg.trainer.kl_rollback_threshold); mark("learning-curve PNG (matplotlib)")
    tracking.log_metrics(mlflow_run_id, derived_only(metrics, run, k), step=k); mark("MLflow log_batch")
    tracking.log_artifact(mlflow_run_id, png, "plots"); mark("MLflow log_artifact (PNG)")
    # tasks.reporting skips artifacts outside a Prefect run: call Prefect directly, as it does inside one
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    create_table_artifact(table=reporting.metrics_rows(run), key="bench-metrics"); mark("Prefect table artifact")
    create_markdown_artifact(markdown=reporting.report_markdown(run, png, [], tracking.run_url(mlflow_run_id)),
                             key="bench-report"); mark("Prefect markdown report artifact")
    return parts


def startup(run_dir: Path, called: float, first_iteration: dict) -> dict:
    setup = json.loads((run_dir / "manifest.json").read_text())
    pre, pack = setup["preprocess"], setup["pack"]
    return {"flow call → preprocess": pre["started_at"] - called, "preprocess + pack": pack["finished_at"] - pre["started_at"],
            "pack → iteration 1 (incl. iteration-0 validation)": first_iteration["rollout"]["started_at"] - pack["finished_at"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=3, help="iterations measured (one more is run)")
    parser.add_argument("--keep", type=Path, help="copy the run directory here")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="rlhf-bench-overhead-"))
    try:
        offline_env(home)
        run_dir, called, ended, runs, parts = run_flow(home, args.iterations + 1)
        rows = iteration_rows(run_dir, args.iterations + 1)
        first = json.loads((run_dir / "iter_1" / "manifest.json").read_text())
        after = json.loads((run_dir / f"iter_{args.iterations + 1}" / "manifest.json").read_text())
        tasks = task_breakdown(runs, (first["rollout"]["started_at"], after["rollout"]["started_at"]), args.iterations)
        last = json.loads((run_dir / f"iter_{args.iterations + 1}" / "manifest.json").read_text())
        start_costs = startup(run_dir, called, first)
        if args.keep:
            shutil.copytree(run_dir, args.keep, dirs_exist_ok=True)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    print(f"\nflow: {args.iterations + 1} iterations, {ended - called:.1f} s from call to return")
    print(f"{'iter':>4} {'wall s':>7} {'compute s':>9} " + " ".join(f"{s:>8}" for s in STAGES)
          + f" {'guard→next s':>12} {'overhead':>8}")
    for r in rows:
        print(f"{r['k']:>4} {r['wall']:>7.2f} {r['compute']:>9.2f} " + " ".join(f"{r.get(s, 0.0):>8.2f}" for s in STAGES)
              + f" {r['after_guard']:>12.2f} {r['share']:>8.1%}")
    mean = sum(r["share"] for r in rows) / len(rows)
    print(f"mean overhead share: {mean:.1%} (goal ≤ 5%)")
    stage_means = {s: sum(r.get(s, 0.0) for r in rows) / len(rows) for s in STAGES}
    stage_means["kl-guard"] = stage_means.pop("guard")
    print("per iteration, mean seconds: Prefect task run (as the server recorded it) vs the stage body inside it")
    for name, sec in tasks:
        inner = stage_means.get(name)
        print(f"  {name:<20} {sec:>7.2f}" + (f"   stage body {inner:.2f}, wrapper {sec - inner:.2f}" if inner is not None else ""))
    print("finish-iteration parts, re-run once after the flow (s):")
    for name, sec in parts.items():
        print(f"  {name:<45} {sec:>6.2f}")
    print("one-off start-up:")
    for name, sec in start_costs.items():
        print(f"  {name}: {sec:.2f} s")
    tail_end = max(last[s]["finished_at"] for s in STAGES if s in last)
    print(f"  after the last guard → flow return (finish-iteration, export, MLflow close): {ended - tail_end:.2f} s")


if __name__ == "__main__":
    main()
