"""Bookkeeping tasks around the stages: the MLflow run's lifecycle, the start and the close of an
iteration (KL controller snapshot; metrics, learning curve, artifacts, alerts, checkpoint pruning)."""

from __future__ import annotations

from typing import Any, Optional

from prefect import task
from prefect.cache_policies import NO_CACHE

from rlhf_core.config import RLHFConfig
from rlhf_core.guard import begin_iteration
from rlhf_core.io import timing
from rlhf_core.io.manifest import read_manifest
from rlhf_core.io.rundir import RunDir
from rlhf_core.pipeline import alerts, curve_due, iteration_metrics, prune_checkpoints
from tasks import reporting, tracking
from tasks.stages import IO_RETRIES

NO_RESULTS = dict(cache_policy=NO_CACHE, persist_result=False)


@task(name="start-tracking", **NO_RESULTS, **IO_RETRIES)
def start_tracking_task(cfg: RLHFConfig, run_dir: str, stage: Optional[str] = None,
                        iteration: Optional[int] = None) -> str:
    """Open (or reopen, on resume) the run's MLflow run; a stage rerun gets a nested run. Returns its id."""
    from prefect.runtime import flow_run

    run = RunDir(run_dir)
    flow_run_id = str(flow_run.id) if flow_run.id else None
    if stage is None:
        run_id = tracking.start_pipeline_run(run, cfg, flow_run_id)
    else:
        run_id = tracking.start_stage_run(run, cfg, stage, iteration, flow_run_id)
    reporting.logger().info("MLflow run %s in %s", run_id, tracking.tracking_uri())
    return run_id


@task(name="finish-tracking", **NO_RESULTS, **IO_RETRIES)
def finish_tracking_task(mlflow_run_id: str, status: str = "FINISHED", reason: Optional[str] = None) -> None:
    if reason:
        tracking.set_tags(mlflow_run_id, {"halt_reason": reason})
    tracking.finish(mlflow_run_id, status)


@task(name="begin-iteration", task_run_name="begin-iter{iteration}", **NO_RESULTS)
def begin_iteration_task(run_dir: str, iteration: int) -> dict:
    """Snapshot the KL controller before the iteration (restored by a rollback, or after a crash
    inside gae so a resumed gae does not update it twice)."""
    with timing.span("task:begin-iteration"):
        return begin_iteration(RunDir(run_dir), iteration)


def derived_only(metrics: dict[str, float], run: RunDir, k: int) -> dict[str, float]:
    """Metrics the stage tasks did not already log themselves (aliases and iteration totals)."""
    logged = set()
    for stage, rec in read_manifest(run, k).items():
        logged |= set((rec.get("metrics") or {}).keys())
        logged.add(f"perf/stage_seconds/{stage}")
    return {key: v for key, v in metrics.items() if key not in logged}


@task(name="finish-iteration", task_run_name="finish-iter{iteration}", **NO_RESULTS)
def finish_iteration_task(cfg: RLHFConfig, run_dir: str, iteration: int, mlflow_run_id: Optional[str] = None,
                          progress_id: Any = None, prune: bool = True) -> dict:
    """Close iteration k: iter_k/iteration_metrics.json, MLflow batch + learning-curve PNG, Prefect
    table, report and progress, alerts in the log, old checkpoints pruned (not after a single-stage
    rerun, which may have just rebuilt an old checkpoint on purpose). Returns the metrics."""
    with timing.span("task:finish-iteration"):
        return _finish_iteration(cfg, run_dir, iteration, mlflow_run_id, progress_id, prune)


def _finish_iteration(cfg: RLHFConfig, run_dir: str, iteration: int, mlflow_run_id: Optional[str],
                      progress_id: Any, prune: bool) -> dict:
    run = RunDir(run_dir)
    k = iteration
    log = reporting.logger()
    metrics = iteration_metrics(cfg, run, k)
    warnings = alerts(cfg, metrics)
    for line in warnings:  # a KL breach is a warning; the clip-fraction signal is information
        (log.warning if line.startswith("KL") else log.info)("alert (iteration %d): %s", k, line)
        run.append_event("alert", k, message=line)
    if mlflow_run_id:
        tracking.log_metrics(mlflow_run_id, derived_only(metrics, run, k), step=k)
    reporting.table(reporting.metrics_rows(run), key=reporting.artifact_key(run, "metrics"),
                    description="per-iteration metrics")
    if curve_due(cfg, run, k):
        png = reporting.plot_learning_curve(run, run.root / "plots" / "learning_curve.png",
                                            kl_threshold=cfg.trainer.kl_rollback_threshold)
        if mlflow_run_id:
            tracking.log_artifact(mlflow_run_id, png, "plots")
        reporting.markdown(reporting.report_markdown(run, png, warnings, tracking.run_url(mlflow_run_id)
                                                     if mlflow_run_id else None),
                           key=reporting.artifact_key(run, "report"), description=f"run report after iteration {k}")
    reporting.progress_update(progress_id, k, cfg.trainer.total_iterations)
    pruned = prune_checkpoints(cfg, run) if prune else []
    if pruned:
        log.info("pruned checkpoints of iterations %s (kept: last-good and the last %d save points)",
                 pruned, cfg.trainer.max_ckpt_to_keep)
    return {"metrics": metrics, "alerts": warnings, "pruned": pruned}
