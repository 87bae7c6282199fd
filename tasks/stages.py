"""One Prefect task per stage, built from the stage's declaration (``run.stage_order.STAGES``) and its
function (``stages.catalog.CATALOG``): a thin wrapper over the core stage function.

Each task resolves the run directory, calls ``run_<stage>(cfg, run, iteration, force)``, logs the
stage's metrics to MLflow (one batch, step = iteration) and publishes a markdown artifact with the
stage's summary — unless called with ``report=False``: the pipeline flow reports a whole iteration
at once (one MLflow batch, one markdown artifact: tasks.iteration), single-stage reruns per stage.
Tasks take and return small things: the config, paths, a result dict (never tensors) — and the
flow run's session (``run.session.RunSession``), a handle on the models it keeps in memory, for
the stages whose function takes ``session``; without one they read every model from disk. Prefect's result caching is off: whether a stage reruns is decided by the run's manifest
(same input hashes and config hash → skipped), which also survives a crash and a CLI rerun.

Retries only where the failure can be a transient I/O error (``OSError`` other than a missing file
or a permission problem); never on the update, whose optimizer step is not idempotent, nor on the
guard, whose verdict decides a commit.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from prefect import task
from prefect.cache_policies import NO_CACHE

from rlhf_core.config import RLHFConfig
from rlhf_core.io import timing
from rlhf_core.run.layout import RunDir
from rlhf_core.control.export import ExportRefused, check_export_allowed, export_actor
from rlhf_core.run.lifecycle import settle
from rlhf_core.run.manifest import mark_skipped
from rlhf_core.run.report import stage_numbers
from rlhf_core.run.stage_order import STAGES, StageSpec
from rlhf_core.run.session import RunSession
from rlhf_core.stages.base import StageResult
from rlhf_core.stages.catalog import CATALOG, StageFunctions, stage_name
from rlhf_core.stages.repair import Unrepairable, make_last_good_durable, prepare_export
from rlhf_core.training.run_trainer import check_background_writes, settle_resident
from tasks import mlflow_tracking, prefect_artifacts

NOT_TRANSIENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


def transient_io_error(task, task_run, state) -> bool:
    """Retry condition: the task failed with an OSError that may pass (a busy or flaky filesystem)."""
    try:
        state.result(raise_on_failure=True)
    except OSError as exc:
        return not isinstance(exc, NOT_TRANSIENT)
    except BaseException:
        return False
    return False


IO_RETRIES = dict(retries=2, retry_delay_seconds=3, retry_condition_fn=transient_io_error)
NO_RESULTS = dict(cache_policy=NO_CACHE, persist_result=False)


def _stage_task(spec: StageSpec, functions: StageFunctions):
    """The Prefect task of ``spec``: run its function, log it, and report it (MLflow metrics, a
    Prefect artifact) when ``report``."""

    def run_stage(cfg: RLHFConfig, run_dir: str, iteration: Optional[int] = None, force: bool = False,
                  mlflow_run_id: Optional[str] = None, report: bool = True,
                  session: Optional[RunSession] = None) -> dict[str, Any]:
        with timing.span(f"task:{spec.name}"):
            run = RunDir(run_dir)
            models = {"session": session} if functions.uses_models else {}
            result = functions.run(cfg, run, iteration, force=force, **models)
            log = prefect_artifacts.logger()
            if result.skipped:
                mark_skipped(run, iteration, spec.name)
            elif mlflow_run_id and report:
                mlflow_tracking.log_metrics(mlflow_run_id, stage_numbers(run, iteration, spec.name), step=iteration)
            where = f" iteration {iteration}" if iteration is not None else ""
            log.info("[%s%s] %s", spec.name, where,
                     "skipped (up to date)" if result.skipped else f"done in {result.seconds:.1f}s")
            for line in result.summary:
                log.info("  %s", line)
            out = result.to_dict()
            if report:
                prefect_artifacts.markdown(prefect_artifacts.stage_markdown(out), description=f"{spec.name}{where}")
            return out

    run_stage.__name__ = run_stage.__qualname__ = f"{spec.name}_task"  # Prefect keys a task by its function
    run_stage.__doc__ = spec.help
    naming = {"task_run_name": f"{spec.task}-iter{{iteration}}"} if spec.per_iteration else {}
    return task(name=spec.task, **naming, **NO_RESULTS, **(IO_RETRIES if spec.retries else {}))(run_stage)


STAGE_TASKS = {name: _stage_task(spec, CATALOG[name]) for name, spec in STAGES.items()}
"""One Prefect task per stage, built from its declaration (``run.stage_order.STAGES``) and its
functions (``stages.catalog.CATALOG``), so a new stage needs no line here: the pipeline runs the
setup stages by name in the declared order, the recipe each iteration stage by its function."""


def stage_task(function: Callable[..., StageResult]):
    """The Prefect task of the stage whose function is ``function`` (``stages.catalog``)."""
    return STAGE_TASKS[stage_name(function)]


@task(name="export", **NO_RESULTS, **IO_RETRIES)
def export_task(cfg: RLHFConfig, run_dir: str, mlflow_run_id: Optional[str] = None) -> dict:
    """Merge LoRA (if any) and save the last-good actor in Hugging Face format, when the latest
    validation accuracy clears trainer.export_min_val_score; a refusal is reported, not raised."""
    run = RunDir(run_dir)
    log = prefect_artifacts.logger()
    try:
        check_export_allowed(cfg, run)  # a refusal first: before any repair works for nothing
        for line in prepare_export(run, cfg):  # damage rebuilt; a crash's record-only state written
            log.warning(line)
        path = export_actor(cfg, run)
    except (ExportRefused, Unrepairable) as exc:
        # INFO: `rlhf run`'s closing block prints the reason (a WARNING here said it twice on the console)
        log.info("export refused: %s", exc)
        prefect_artifacts.markdown(f"### export refused\n\n{exc}", key=prefect_artifacts.artifact_key(run, "export"))
        if mlflow_run_id:
            mlflow_tracking.set_tags(mlflow_run_id, {"export": "refused", "export.reason": str(exc)})
        return {"exported": False, "reason": str(exc)}
    log.info("exported the actor to %s", path)
    prefect_artifacts.markdown(f"### exported\n\nHugging Face actor: `{path}`", key=prefect_artifacts.artifact_key(run, "export"))
    if mlflow_run_id:
        mlflow_tracking.set_tags(mlflow_run_id, {"export": str(path)})
    return {"exported": True, "path": str(path)}


@task(name="make-durable", **NO_RESULTS)
def make_durable_task(run_dir: str) -> Optional[str]:
    """Last-good's checkpoint written when its state is only in its record (a flow run with nothing
    left to train does what a training one does at its end)."""
    line = make_last_good_durable(RunDir(run_dir))
    if line:
        prefect_artifacts.logger().info(line)
    return line


@task(name="settle", task_run_name="settle-iter{iteration}", **NO_RESULTS)
def settle_task(cfg: RLHFConfig, run_dir: str, iteration: int, policy: str, attempt: int,
                session: Optional[RunSession] = None) -> str:
    """Act on iteration K's verdict: commit (last_good.json moves, one atomic rename) or roll back
    (the checkpoint discarded), then tell the resident trainer (a commit may start a background
    save, a rollback puts its in-memory snapshot back). First the background save of an earlier
    commit must have succeeded: a failed one stops the run here, in one line. Never retried: it
    decides a commit."""
    with timing.span("task:settle"):
        run = RunDir(run_dir)
        session = session or RunSession()  # none: no trainer kept in memory to tell
        check_background_writes(session)  # a save that failed stops the run before anything commits on top of it
        outcome = settle(run, iteration, policy=policy, attempt=attempt)
        settle_resident(cfg.trainer, session, iteration, outcome)
        return outcome
