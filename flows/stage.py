"""One stage as its own flow run: what `rlhf stage NAME --run-dir RUN [--iteration K]` runs.

The stage reads the inputs already in the run directory, replaces its outputs atomically and marks
the stages after it stale (rlhf_core.stages.base.stage_record). Overrides apply to this stage run
only: config.yaml is never changed by a rerun (the stage's manifest record lists them), and
``rlhf_rebuild`` (`rlhf rebuild RUN`) reruns what they left out of date with config.yaml. Its MLflow
run is nested under the run directory's pipeline run, opened once the stage did work: a stage found
up to date is skipped without a nested run, alerts or an iteration report. A guard rerun acts on
its verdict on disk: commit moves last_good; a breach discards the iteration's checkpoint (an
iteration that is already committed is only re-measured, never rolled back by hand).
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator
from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from rlhf_core.config import RLHFConfig
from rlhf_core.run.layout import RunDir
from rlhf_core.errors import RLHFError
from rlhf_core.io.allocator import keep_freed_memory
from rlhf_core.run.lifecycle import last_good_iteration, require_reachable, rollback_count, settle
from rlhf_core.run.lock import RunLock
from rlhf_core.control.plan import logs_to, resume_point, stage_config
from rlhf_core.stages.base import out_of_date, stage_label
from rlhf_core.run.stage_order import STAGES
from flows.params import FlowParams
from tasks import prefect_artifacts
from tasks.prefect_runs import claim_run_directory, keep_command_sigterm
from tasks.iteration import finish_iteration_task, finish_tracking_task, start_tracking_task
from tasks.stages import STAGE_TASKS

StageName = Literal[tuple(STAGES)]  # the stage order's names, in its order (the Run form's choices)


class StageParams(FlowParams):
    """What the Prefect UI's Run form asks for to (re)run one stage."""

    stage: StageName = Field(description="The stage to (re)run")
    run_dir: str = Field(description="The run directory (created for setup stages if absent)")
    iteration: Optional[int] = Field(None, ge=0, description="Iteration K (per-iteration stages only; validate "
                                     "takes 0 = the initial policy)")
    config: Optional[str] = Field(None, description="YAML preset; default: the run's saved config.yaml")
    overrides: list[str] = Field(default_factory=list, description="Dotted key=value overrides")
    force: bool = Field(False, description="Rerun even when inputs and config are unchanged")

    @model_validator(mode="after")
    def _iteration_matches_stage(self) -> "StageParams":
        per_iteration = STAGES[self.stage].per_iteration
        if per_iteration and self.iteration is None:
            raise ValueError(f"stage {self.stage!r} runs per iteration: give iteration=K")
        if per_iteration and self.iteration == 0 and self.stage != "validate":
            raise ValueError(f"stage {self.stage!r} needs iteration K >= 1 (only validate takes 0, the initial policy)")
        if not per_iteration and self.iteration is not None:
            raise ValueError(f"stage {self.stage!r} is a setup stage: it takes no iteration")
        return self


def _stage_run_name() -> str:
    from prefect.runtime import flow_run

    params = flow_run.parameters.get("params") or {}
    get = params.get if isinstance(params, dict) else lambda key: getattr(params, key, None)
    return f"{get('stage')}" + (f"-iter{get('iteration')}" if get("iteration") else "")


@task(name="apply-guard-verdict", task_run_name="apply-verdict-iter{iteration}", cache_policy=NO_CACHE,
      persist_result=False)
def apply_verdict_task(run_dir: str, iteration: int) -> str:
    """Act on a rerun guard's verdict (``lifecycle.settle``). An iteration at or before last-good is
    only re-measured: rolling back past last-good by hand would orphan the iterations built on it."""
    run = RunDir(run_dir)
    last_good = last_good_iteration(run)
    if last_good >= iteration:
        # info, not a warning: what a rebuild of committed iterations does by design (the command says it)
        prefect_artifacts.logger().info("iteration %d is at or before last-good (%d): verdict recorded, nothing moved",
                                        iteration, last_good)
        return "recorded"
    done = settle(run, iteration, policy="stage-rerun", attempt=rollback_count(run, iteration) + 1)
    if done == "rollback":
        prefect_artifacts.logger().warning("iteration %d rolled back by the guard rerun", iteration)
    return {"commit": "committed", "rollback": "rolled_back"}[done]


@flow(name="rlhf-stage", flow_run_name=_stage_run_name, persist_result=False)
def rlhf_stage(params: StageParams) -> dict:
    """Rerun one stage on a run directory; returns the stage result."""
    keep_command_sigterm()  # SIGTERM stops an `rlhf` command at once (Prefect's handler would report first)
    keep_freed_memory()  # as the pipeline flow: freed activations stay this process's (rlhf_core.io.allocator)
    prefect_artifacts.redact_prefect_logs()
    run = RunDir(params.run_dir)
    with RunLock(run) as lock:
        if lock.outermost:  # not inside `rlhf rebuild`, which speaks for the run itself
            claim_run_directory(run)
        # config.yaml is left as it is: the overrides are this stage run's only (its manifest record lists them)
        require_reachable(run, params.stage, params.iteration)  # before anything writes an iter_K
        cfg = stage_config(run, params.config, params.overrides)  # step count included (the update's lr schedule)
        mlflow_run_id = None
        try:
            stage_task = STAGE_TASKS[params.stage]
            args = (cfg, str(run.root)) + ((params.iteration,) if params.iteration is not None else ())
            result = stage_task(*args, force=params.force)  # its MLflow run is opened below, once it did work
            if params.stage == "preprocess":
                stage_config(run, params.config, params.overrides)  # fills config.yaml's step count from the prompts
            if params.stage == "guard":  # also when skipped: a crash may have come between the verdict and its settling
                result["action"] = apply_verdict_task(str(run.root), params.iteration)
            if not changed_anything(result):  # up to date: no nested MLflow run, no alerts, no iteration report
                return result
            if logs_to(cfg, "mlflow"):
                mlflow_run_id = start_tracking_task(cfg, str(run.root), stage=params.stage, iteration=params.iteration,
                                                    log_stage=True)
            if params.iteration is not None:
                finish_iteration_task(cfg, str(run.root), params.iteration, mlflow_run_id=mlflow_run_id, prune=False)
        except Exception as exc:
            record_failure(cfg, str(run.root), params, mlflow_run_id, exc)
            raise
        finish_tracking_task(mlflow_run_id)
    return result


def record_failure(cfg: RLHFConfig, run_dir: str, params: StageParams, mlflow_run_id: Optional[str],
                   exc: Exception) -> None:
    """A failed rerun is recorded in MLflow (a nested run opened for it when the stage failed before
    one was); a failure to record it is logged, never raised over the stage's own error."""
    try:
        if mlflow_run_id is None and logs_to(cfg, "mlflow"):
            mlflow_run_id = start_tracking_task(cfg, run_dir, stage=params.stage, iteration=params.iteration)
        finish_tracking_task(mlflow_run_id, "FAILED", reason=f"{type(exc).__name__}: {exc}")
    except Exception as failure:
        prefect_artifacts.logger().warning("the failed %s rerun is not recorded in MLflow: %s", params.stage, failure)


def changed_anything(result: dict) -> bool:
    """Whether a stage rerun did work: it ran (not skipped as up to date), or it is a guard whose
    verdict moved last-good or rolled the iteration back."""
    return not result["skipped"] or result.get("action") in ("committed", "rolled_back")


@flow(name="rlhf-rebuild", persist_result=False)
def rlhf_rebuild(run_dir: str) -> list[dict]:
    """Rerun, in run order and with the run's config.yaml, every stage at or before last-good that is
    stale or was rerun with overrides (``stages.base.out_of_date``), each as an ``rlhf_stage`` flow
    run, so that a resume or an export can build on the run again. Returns the stage results."""
    keep_command_sigterm()  # SIGTERM stops an `rlhf` command at once (Prefect's handler would report first)
    prefect_artifacts.redact_prefect_logs()
    run = RunDir(run_dir)
    results: list[dict] = []
    done: set[tuple] = set()
    with RunLock(run) as lock:
        if lock.outermost:
            claim_run_directory(run)
        while found := out_of_date(run, resume_point(run) - 1):
            k, stage, _ = found[0]
            if (k, stage) in done:  # rerun with config.yaml already: a second pass would not change it
                raise RLHFError(f"rebuilding {run.root}: {stage_label(k, stage)} is still out of date after its "
                                "rerun; see `rlhf status`")
            done.add((k, stage))
            results.append(rlhf_stage(StageParams(stage=stage, run_dir=str(run.root), iteration=k, force=True)))
    return results
