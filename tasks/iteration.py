"""Bookkeeping tasks around the stages: the MLflow run's lifecycle and the close of an iteration
(metrics, learning curve, artifacts, alerts, checkpoint pruning)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from prefect import task
from prefect.cache_policies import NO_CACHE

from rlhf_core.config import RLHFConfig
from rlhf_core.io import timing
from rlhf_core.run.layout import RunDir
from rlhf_core.run.lifecycle import committed_iterations, prune_checkpoints
from rlhf_core.run.report import ALERT_KINDS, alert_history, iteration_alerts, iteration_numbers, save_iteration_metrics, stage_numbers
from rlhf_core.run.schedule import curve_due
from tasks import mlflow_tracking, prefect_artifacts
from tasks.events import emit_alert
from tasks.stages import IO_RETRIES

NO_RESULTS = dict(cache_policy=NO_CACHE, persist_result=False)


@task(name="start-tracking", **NO_RESULTS, **IO_RETRIES)
def start_tracking_task(cfg: RLHFConfig, run_dir: str, stage: Optional[str] = None,
                        iteration: Optional[int] = None, log_stage: bool = False) -> str:
    """Open (or reopen, on resume) the run's MLflow run; a stage rerun gets a nested run, opened
    once the stage has run (a skipped stage records nothing), with the stage's metrics when
    ``log_stage``. Returns its id."""
    from prefect.runtime import flow_run

    run = RunDir(run_dir)
    flow_run_id = str(flow_run.id) if flow_run.id else None
    if stage is None:
        run_id = mlflow_tracking.start_pipeline_run(run, cfg, flow_run_id)
    else:
        run_id = mlflow_tracking.start_stage_run(run, cfg, stage, iteration, flow_run_id)
        if log_stage:
            mlflow_tracking.log_metrics(run_id, stage_numbers(run, iteration, stage), step=iteration)
    prefect_artifacts.logger().info("MLflow run %s in %s", run_id, mlflow_tracking.display_uri())
    return run_id


@task(name="finish-tracking", **NO_RESULTS, **IO_RETRIES)
def finish_tracking_task(mlflow_run_id: Optional[str], status: str = "FINISHED", reason: Optional[str] = None) -> None:
    """Close the MLflow run (nothing to do without one: trainer.logger without mlflow)."""
    if mlflow_run_id is None:
        return
    if reason:
        mlflow_tracking.set_tags(mlflow_run_id, {"halt_reason": reason})
    mlflow_tracking.finish(mlflow_run_id, status)


DONE_MARK = "perf/iteration_seconds"
"""Logged by every iteration's batch, never by a stage: its steps in MLflow are the iterations whose
batch landed (one log_batch is one store transaction)."""


@dataclass
class IterationReport:
    """The views of a closed iteration, ready to publish (here or on a background reporter)."""

    run_dir: str
    iteration: int
    total: int
    mlflow_run_id: Optional[str]
    batch: dict[str, float]
    stages_text: Optional[str]
    """One markdown section per stage that ran (None: the stage tasks published their own)."""
    rows: list[dict[str, Any]]
    alerts: list[str]
    curve: Optional[dict[str, Any]]
    """Snapshot the learning curve is drawn from ({"by_iter", "rollbacks", "kl_threshold"}), when due."""
    progress_id: Any = None


@task(name="finish-iteration", task_run_name="finish-iter{iteration}", **NO_RESULTS)
def finish_iteration_task(cfg: RLHFConfig, run_dir: str, iteration: int, mlflow_run_id: Optional[str] = None,
                          progress_id: Any = None, prune: bool = True,
                          stage_results: Optional[list[dict]] = None, publish: bool = True) -> dict:
    """Close iteration k: iter_k/iteration_metrics.json, alerts in the log, old checkpoints pruned
    (not after a single-stage rerun, which may have just rebuilt an old checkpoint on purpose); then
    its views: one MLflow batch, the learning-curve PNG, Prefect table, report and progress.

    ``stage_results``: the pipeline flow's stage tasks ran with report=False; the batch then holds
    every stage's metrics and one markdown artifact summarises the stages. ``publish=False`` leaves
    the views to the caller (returned as ``report``, an ``IterationReport``). Returns the metrics."""
    with timing.span("task:finish-iteration"):
        return _finish_iteration(cfg, run_dir, iteration, mlflow_run_id, progress_id, prune, stage_results, publish)


def _finish_iteration(cfg: RLHFConfig, run_dir: str, iteration: int, mlflow_run_id: Optional[str],
                      progress_id: Any, prune: bool, stage_results: Optional[list[dict]], publish: bool) -> dict:
    run = RunDir(run_dir)
    k = iteration
    log = prefect_artifacts.logger()
    numbers = iteration_numbers(cfg.data, run, k)
    save_iteration_metrics(run, k, numbers.metrics)
    metrics = numbers.metrics
    raised = iteration_alerts(cfg.trainer, metrics, alert_history(run, k))  # a change worth attention, not a level
    for alert in raised:  # a warning also goes out as a Prefect event; the clip-fraction signal is information
        loud = ALERT_KINDS[alert.kind] == "warning"
        (log.warning if loud else log.info)("alert (iteration %d): %s", k, alert.message)
        run.append_event("alert", k, message=alert.message, alert=alert.kind)
        if loud:
            emit_alert(run, alert.kind, k, alert.message)
    warnings = [alert.message for alert in raised]
    report = IterationReport(
        run_dir=run_dir, iteration=k, total=cfg.trainer.total_iterations, mlflow_run_id=mlflow_run_id,
        # the pipeline's stage tasks did not log their metrics; a single-stage rerun's did
        batch=numbers.batch if stage_results is not None else numbers.derived,
        stages_text=(stages_markdown(k, stage_results) if stage_results else None),
        rows=prefect_artifacts.metrics_rows(run), alerts=warnings, progress_id=progress_id,
        curve=(prefect_artifacts.curve_snapshot(run, cfg.trainer.kl_rollback_threshold) if curve_due(cfg.trainer, run, k) else None))
    pruned = prune_checkpoints(cfg.trainer, run) if prune else []
    if pruned:
        log.info("pruned checkpoints of iterations %s (kept: last-good and the last %d save points)",
                 pruned, cfg.trainer.max_ckpt_to_keep)
    if publish:
        publish_iteration(report)
    return {"metrics": metrics, "alerts": warnings, "pruned": pruned, **({} if publish else {"report": report})}


def stages_markdown(k: int, stage_results: list[dict]) -> str:
    """One markdown document of an iteration's stages (what each stage task publishes on its own)."""
    return "\n\n".join([f"## Iteration {k}"] + [prefect_artifacts.stage_markdown(r) for r in stage_results])


def publish_iteration(report: IterationReport) -> None:
    """The views of one iteration: MLflow batch (+ learning curve), Prefect artifacts. Reads
    nothing the next iteration writes (the report carries its snapshot)."""
    run, k = RunDir(report.run_dir), report.iteration
    if report.mlflow_run_id:
        mlflow_tracking.log_metrics(report.mlflow_run_id, report.batch, step=k)
    if report.stages_text:
        prefect_artifacts.markdown(report.stages_text, description=f"stages of iteration {k}")
    prefect_artifacts.table(report.rows, key=prefect_artifacts.artifact_key(run, "metrics"), description="per-iteration metrics")
    if report.curve is not None:
        png = prefect_artifacts.plot_learning_curve(run, run.learning_curve, **report.curve)
        if report.mlflow_run_id:
            mlflow_tracking.log_artifact(report.mlflow_run_id, png, "plots")
        url = mlflow_tracking.run_url(report.mlflow_run_id) if report.mlflow_run_id else None
        prefect_artifacts.markdown(prefect_artifacts.report_markdown(run, png, report.alerts, url, rows=report.rows),
                           key=prefect_artifacts.artifact_key(run, "report"), description=f"run report after iteration {k}")
    prefect_artifacts.progress_update(report.progress_id, k, report.total)


@task(name="backfill-tracking", **NO_RESULTS, **IO_RETRIES)
def backfill_tracking_task(cfg: RLHFConfig, run_dir: str, mlflow_run_id: str) -> list[int]:
    """Log the batch of every committed iteration whose batch is not in MLflow (a crash between the
    commit and the report, a background report that failed). Returns those iterations."""
    with timing.span("task:backfill-tracking"):
        return backfill_metrics(cfg, RunDir(run_dir), mlflow_run_id)


def backfill_metrics(cfg: RLHFConfig, run: RunDir, mlflow_run_id: str) -> list[int]:
    logged = {step for step, _ in mlflow_tracking.metric_history(mlflow_run_id, DONE_MARK)}
    if mlflow_tracking.failure(mlflow_run_id):  # tracking is off for this run: said once already
        return []
    missing = [k for k in committed_iterations(run) if k not in logged]
    for k in missing:
        numbers = iteration_numbers(cfg.data, run, k)
        save_iteration_metrics(run, k, numbers.metrics)
        mlflow_tracking.log_metrics(mlflow_run_id, numbers.batch, step=k)
    if missing and not mlflow_tracking.failure(mlflow_run_id):
        prefect_artifacts.logger().warning("MLflow was missing the metrics of committed iterations %s: logged them from "
                                   "the run directory", missing)
    return missing
