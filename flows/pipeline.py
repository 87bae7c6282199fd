"""The pipeline flow: preprocess and pack once, then N iterations of

    rollout → score → gae → update → kl-guard → settle → (validate) → finish-iteration

(one iteration, step by step with its math: ``flows.recipe.ppo_iteration``), where settle acts on the guard's verdict (``rlhf_core.run.lifecycle.settle``): commit moves
last_good.json (one atomic rename); rollback discards the new checkpoint (the KL controller's
state is gae's output: the retry's gae starts again from the committed predecessor's). After a rollback, ``trainer.on_kl_breach`` decides: retry the iteration (smaller learning rate, larger KL coefficient,
at most ``trainer.max_rollbacks`` times) or halt the flow run with a message saying how to go on.
The flow holds the run directory's lock; it contains wiring only (decisions live in rlhf_core).

Reporting is per iteration, not per stage: the stage tasks run with report=False and
finish-iteration emits one MLflow batch and one markdown artifact for the whole iteration. Its
views (MLflow batch, learning curve, Prefect artifacts) are published by a background reporter
(tasks.background_publisher) while the next iteration runs; the reporter is drained before the flow returns or
fails, and committed iterations whose batch is not in MLflow are logged from the run directory
(at the end, and on resume after a crash).

    rlhf run -c configs/demo.yaml trainer.total_iterations=4      (CLI)
    rlhf_pipeline(PipelineParams(config="configs/demo.yaml", iterations=4))   (Python / deployment)
"""

from __future__ import annotations

import gc
from typing import Optional

from pydantic import Field
from prefect import flow

from rlhf_core.config import RLHFConfig
from rlhf_core.data.outcome import NoPromptsError, preprocess_headline
from rlhf_core.errors import CheckpointError
from rlhf_core.io.allocator import keep_freed_memory
from rlhf_core.run.lifecycle import KLGuardHalt, committed_iterations
from rlhf_core.run.lock import RunLock
from rlhf_core.control.opening import open_run
from rlhf_core.control.plan import RunPlan, logs_to, plan_run, resolve_iterations
from rlhf_core.run.report import format_iteration_header, format_iteration_row, iteration_metrics
from rlhf_core.run.stage_order import SETUP_STAGES, VALIDATE
from rlhf_core.run.schedule import initial_validation_due, missed_validations, validate_due
from rlhf_core.run.session import RunSession
from rlhf_core.stages.validate import BASE_PREFIX, accuracy_text
from rlhf_core.training.run_trainer import resident_models, rollout_engine_kept
from tasks import mlflow_tracking, prefect_artifacts
from tasks.prefect_runs import claim_run_directory, fail_misplaced_parameters, keep_command_sigterm
from tasks.iteration import (
    backfill_tracking_task, finish_iteration_task, finish_tracking_task, publish_iteration,
    start_tracking_task,
)
from tasks.background_publisher import Reporter
from tasks.stages import STAGE_TASKS, export_task, make_durable_task
from flows.params import FlowParams
from flows.recipe import ppo_iteration


class PipelineParams(FlowParams):
    """What the Prefect UI's Run form asks for."""

    config: Optional[str] = Field("configs/demo.yaml", description="YAML preset: defaults ← preset ← overrides. "
                                  "Ignored on resume (the run's saved config is used).")
    overrides: list[str] = Field(default_factory=list, description="Dotted overrides, e.g. "
                                 "algorithm.kl_ctrl.kl_coef=0.002")
    iterations: Optional[int] = Field(None, ge=1, description="PPO iterations (sets trainer.total_iterations)")
    run_name: Optional[str] = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                                    description="Run directory name under trainer.runs_root (default: a timestamp)")
    resume: Optional[str] = Field(None, description="An existing run directory to continue after its last "
                                  "committed iteration")


def _flow_run_name() -> str:
    from prefect.runtime import flow_run

    params = flow_run.parameters.get("params") or {}
    get = params.get if isinstance(params, dict) else lambda key: getattr(params, key, None)
    if get("resume"):
        return f"resume-{str(get('resume')).rstrip('/').rsplit('/', 1)[-1]}"
    return f"run-{get('run_name') or 'new'}"


@flow(name="rlhf-pipeline", flow_run_name=_flow_run_name, persist_result=False,
      on_crashed=[fail_misplaced_parameters])
def rlhf_pipeline(params: PipelineParams = PipelineParams()) -> dict:
    """Run (or resume) a PPO RLHF run; returns {run_dir, mlflow_run_id (None without the mlflow
    logger), tracking_failed (why MLflow stopped tracking it, if it did), last_good, metrics, export}."""
    keep_command_sigterm()  # SIGTERM stops an `rlhf` command at once (Prefect's handler would report first)
    keep_freed_memory()  # a Prefect worker runs this flow without the CLI: the allocator setting is set here too
    prefect_artifacts.redact_prefect_logs()
    plan = plan_run(preset=None if params.resume else params.config, overrides=params.overrides,
                    iterations=params.iterations, run_name=params.run_name, resume=params.resume)
    with RunLock(plan.run) as lock:
        open_run(plan)
        if lock.outermost:  # an earlier flow run of this directory killed while Running: Crashed
            claim_run_directory(plan.run)
        # an MLflow run only when trainer.logger names mlflow (None otherwise: nothing is tracked)
        mlflow_run_id = start_tracking_task(plan.cfg, str(plan.run.root)) if logs_to(plan.cfg, "mlflow") else None
        if plan.resumed and mlflow_run_id:  # a crash may have come between an iteration's commit and its report
            backfill_tracking_task(plan.cfg, str(plan.run.root), mlflow_run_id)
        try:
            summary = train(plan, mlflow_run_id)
        except KLGuardHalt as exc:
            finish_tracking_task(mlflow_run_id, "FAILED", reason=str(exc))
            raise
        except KeyboardInterrupt:  # no task here: the Prefect server may have died with the same Ctrl-C
            close_interrupted(mlflow_run_id)
            raise
        except Exception as exc:
            finish_tracking_task(mlflow_run_id, "FAILED", reason=f"{type(exc).__name__}: {exc}")
            raise
        finish_tracking_task(mlflow_run_id)
    # tracking is a view: a failure was one line and cost nothing else; the closing block says it again
    tracking_failed = mlflow_tracking.failure(mlflow_run_id) if logs_to(plan.cfg, "mlflow") else None
    return {**summary, "mlflow_run_id": mlflow_run_id, "tracking_failed": tracking_failed}


def close_interrupted(mlflow_run_id: Optional[str]) -> None:
    """Mark the MLflow run KILLED after Ctrl-C, best effort (the run directory is the record)."""
    if mlflow_run_id is None:
        return
    try:
        mlflow_tracking.set_tags(mlflow_run_id, {"halt_reason": "interrupted (Ctrl-C)"})
        mlflow_tracking.finish(mlflow_run_id, "KILLED")
    except Exception as exc:  # a second failure must not hide the interrupt
        prefect_artifacts.logger().warning("could not mark MLflow run %s as killed: %s", mlflow_run_id, exc)


def train(plan: RunPlan, mlflow_run_id: Optional[str]) -> dict:
    """Setup stages, the training-step count, the validation before training, then the iteration
    loop; prints one table row per iteration when trainer.logger has console."""
    run_dir = str(plan.run.root)
    session = RunSession()  # what this flow run keeps in memory, handed to every stage that uses models
    cfg = setup(plan, mlflow_run_id)
    if plan.resumed:
        redo_missed_validations(plan, cfg, mlflow_run_id, session)
    metrics: dict = {}
    with rollout_engine_kept(cfg, session):  # a vLLM engine, once started, serves every validation and rollout below
        if initial_validation_due(cfg.trainer):  # the policy the run starts from, at its step (0 for a new run)
            metrics = validate_before_training(plan, cfg, mlflow_run_id, session)
        if not plan.iterations():  # trainer.val_only, or nothing left to run on resume
            total = cfg.trainer.total_iterations
            if plan.resumed and plan.first_iteration > total and logs_to(cfg, "console"):
                print(f"nothing left to do: iterations 1..{total} are committed (trainer.total_iterations={total}); "
                      f"`rlhf run --resume {run_dir} --iterations N` goes on to iteration N")
            make_durable_task(run_dir)  # as a training flow run leaves it: last-good on disk
            return {"run_dir": run_dir, "last_good": plan.run.read_json(plan.run.last_good_path), "metrics": metrics,
                    "export": None}
        settle_heap()  # every module is imported by now: keep the GC from rescanning them each iteration
        reporter = Reporter(prefect_artifacts.logger())
        try:
            with resident_models(cfg, plan.run, session):  # one load of actor and critic for all iterations
                cfg, metrics = iterate(plan, cfg, mlflow_run_id, reporter, session)
        finally:  # every queued view is published (or its failure logged) before the flow returns or fails
            failed = reporter.close()
    if failed and mlflow_run_id:  # the batches a failed report did not log (a failed run catches up on resume)
        backfill_tracking_task(cfg, run_dir, mlflow_run_id)
    exported = export_task(cfg, run_dir, mlflow_run_id=mlflow_run_id)
    return {"run_dir": run_dir, "last_good": plan.run.read_json(plan.run.last_good_path), "metrics": metrics,
            "export": exported}


def setup(plan: RunPlan, mlflow_run_id: Optional[str]) -> RLHFConfig:
    """Every setup stage, in its declared order (``run.stage_order.SETUP_STAGES``); returns the
    config with the run's training-step count, known once preprocess has counted the prompts."""
    run_dir, cfg = str(plan.run.root), plan.cfg
    console = logs_to(cfg, "console")
    for name in SETUP_STAGES:
        try:
            result = STAGE_TASKS[name](cfg, run_dir, mlflow_run_id=mlflow_run_id)
        except NoPromptsError as exc:  # the counts first, then the refusal that names the file and the fix
            if console:
                print(preprocess_headline(exc.rows, run_dir))
            raise
        if name == "preprocess":
            if console and not result["skipped"]:
                print(preprocess_headline(result["rows"], run_dir))
            # too little to train on is refused here; verl's total steps need the train prompt count
            cfg = resolve_iterations(plan)
    return cfg


def settle_heap() -> None:
    """Collect once, then move every object alive now (imported modules, Prefect, MLflow, torch and
    transformers state) out of the garbage collector's view (``gc.freeze``). They live for the whole
    process anyway; afterwards each automatic full collection scans only what the iterations
    allocate instead of the whole heap (0.2-0.5 s per collection in a flow process without it)."""
    gc.collect()
    gc.freeze()


def redo_missed_validations(plan: RunPlan, cfg: RLHFConfig, mlflow_run_id: Optional[str], session: RunSession
                            ) -> list[int]:
    """Validations a crash skipped (``schedule.missed_validations``), redone on the policy of their
    step and logged at that step; one whose policy's checkpoint was pruned cannot be, and says so."""
    run, redone = plan.run, []
    for k in missed_validations(cfg.trainer, run, committed_iterations(run)):
        try:
            STAGE_TASKS[VALIDATE](cfg, str(run.root), k, mlflow_run_id=mlflow_run_id, session=session)
        except CheckpointError as exc:
            prefect_artifacts.logger().warning("validation of step %d was missed and cannot be redone: %s", k, exc)
            continue
        if k >= 1:
            iteration_metrics(cfg.data, run, k)
        redone.append(k)
    if redone:
        prefect_artifacts.logger().info("redid the validations a crash skipped: steps %s", redone)
    return redone


def validate_before_training(plan: RunPlan, cfg: RLHFConfig, mlflow_run_id: Optional[str], session: RunSession
                             ) -> dict:
    """verl's val_before_train: validate the starting policy, logged at its step (0 for a new run;
    on resume the last committed iteration, reused when that validation is already on disk, and
    written into that iteration's iteration_metrics.json)."""
    step = plan.first_iteration - 1
    result = STAGE_TASKS[VALIDATE](cfg, str(plan.run.root), step, mlflow_run_id=mlflow_run_id, session=session)
    if step >= 1:  # a committed iteration's record gains it: rlhf status, rlhf query and the curve read it there
        iteration_metrics(cfg.data, plan.run, step)
    if logs_to(cfg, "console"):
        for line in initial_validation_lines(step, result["metrics"]):
            print(line)
    return result["metrics"]


def initial_validation_lines(step: int, metrics: dict) -> list[str]:
    """What the console says of the validation before training: the model before the warm start
    when it was validated too, then the starting policy, each with its 95 % interval."""
    lines = []
    if f"{BASE_PREFIX}/accuracy" in metrics:
        lines.append(f"before the warm start: {BASE_PREFIX}/accuracy {accuracy_text(metrics, BASE_PREFIX)}")
    what = "initial policy" if step == 0 else "resumed policy"
    shown = (accuracy_text(metrics, "val") if "val/accuracy_ci_low" in metrics else
             f"{metrics.get('val/accuracy', float('nan')):.3f}")  # a validation recorded before the intervals were
    return lines + [f"{what} (iteration {step}): val/accuracy {shown}"]


def iterate(plan: RunPlan, cfg: RLHFConfig, mlflow_run_id: Optional[str], reporter: Reporter,
            session: RunSession) -> tuple[RLHFConfig, dict]:
    """Iterations first..last: run, close, queue the views; returns the last config and metrics."""
    from tqdm.auto import tqdm

    run_dir, total = str(plan.run.root), cfg.trainer.total_iterations
    console = logs_to(cfg, "console")
    progress = prefect_artifacts.progress_start(plan.run, total, done=plan.first_iteration - 1)
    metrics: dict = {}
    with tqdm(total=total, initial=plan.first_iteration - 1, desc="iterations", unit="it", disable=not console,
              dynamic_ncols=True) as bar:
        if console:
            bar.write(format_iteration_header())
        for k in plan.iterations():
            cfg, results = ppo_iteration(cfg, run_dir, k, mlflow_run_id, session)
            if validate_due(cfg.trainer, k):
                results.append(STAGE_TASKS[VALIDATE](cfg, run_dir, k, mlflow_run_id=mlflow_run_id, report=False,
                                                     session=session))
            closed = finish_iteration_task(cfg, run_dir, k, mlflow_run_id=mlflow_run_id, progress_id=progress,
                                           stage_results=results, publish=False)
            reporter.submit(f"report of iteration {k}", publish_iteration, closed["report"])
            metrics = closed["metrics"]
            if console:
                bar.write(format_iteration_row(metrics, note="; ".join(closed["alerts"])))
            bar.update(1)
    return cfg, metrics
