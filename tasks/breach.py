"""What follows a KL breach: record it everywhere, then retry the iteration or halt the run.

The rollback itself already happened (``tasks.stages.settle_task``); this task records the event (MLflow tag and metrics, a Prefect artifact,
a warning in the flow log) and applies ``trainer.on_kl_breach``.
"""

from __future__ import annotations

from typing import Optional

from prefect import task
from prefect.cache_policies import NO_CACHE

from rlhf_core.config import RLHFConfig, apply_overrides
from rlhf_core.io import timing
from rlhf_core.io.atomic import fault_point
from rlhf_core.run.layout import RunDir
from rlhf_core.run.lifecycle import RETRY_SCALE, halt_message, read_verdict, record_retry, retry_overrides
from rlhf_core.control.plan import save_config
from rlhf_core.run.report import iteration_numbers
from tasks import mlflow_tracking, prefect_artifacts
from tasks.events import emit_alert


@task(name="kl-breach", task_run_name="kl-breach-iter{iteration}", cache_policy=NO_CACHE, persist_result=False)
def handle_breach_task(cfg: RLHFConfig, run_dir: str, iteration: int, attempt: int,
                       mlflow_run_id: Optional[str] = None, stage_results: Optional[list[dict]] = None) -> dict:
    """Returns {"action": "retry", "overrides": [...], "changes": {...}} or {"action": "halt", "message"}.
    A retry's "overrides" are its config changes (learning rate, kl_loss_coef); the reward's KL
    coefficient is scaled in iter_k/retry.json (shown in "changes"), which the retry's gae reads.

    ``stage_results``: the attempt's stage tasks ran with report=False (pipeline flow); the metrics
    of its rolled-back stages then go into this task's MLflow batch and their summaries into its
    artifact (the stages that stay committed-to-be, rollout and score, report with the iteration)."""
    with timing.span("task:kl-breach"):
        return _handle_breach(cfg, run_dir, iteration, attempt, mlflow_run_id, stage_results)


def _handle_breach(cfg: RLHFConfig, run_dir: str, iteration: int, attempt: int,
                   mlflow_run_id: Optional[str], stage_results: Optional[list[dict]]) -> dict:
    run = RunDir(run_dir)
    k = iteration
    verdict = read_verdict(run, k) or {}
    t = cfg.trainer
    log = prefect_artifacts.logger()
    if str(verdict.get("reason", "")).startswith("non-finite update"):
        alert = f"iteration {k}: {verdict['reason']} — rolled back (attempt {attempt})"
    else:
        alert = (f"KL alert: iteration {k} KL(actor‖ref) {verdict.get('kl_mean', float('nan')):.4f} > "
                 f"threshold {t.kl_rollback_threshold} — rolled back (attempt {attempt})")
    log.warning(alert)
    if mlflow_run_id:
        mlflow_tracking.set_tags(mlflow_run_id, {f"rollback.iter_{k}.attempt_{attempt}": alert, "rollback": "true"})
        batch = iteration_numbers(cfg.data, run, k).rolled_back.get(attempt, {}) if stage_results is not None else {}
        batch.update({"guard/rollback": 1.0, "guard/rollback_kl": verdict.get("kl_mean", 0.0),
                      "guard/rollback_attempt": float(attempt)})
        mlflow_tracking.log_metrics(mlflow_run_id, batch, step=k)
    if t.on_kl_breach == "retry" and attempt <= t.max_rollbacks:
        overrides, changes = retry_overrides(cfg)
        # Two writes, in this order. retry.json first: it holds the whole decision (the scale of the
        # reward's KL coefficient, the config changes as values, an id); config.yaml second. A kill
        # before retry.json leaves the run as it was (the resume redoes the breach and retries once).
        # A kill after it and before the "retry" event below (which names the id) is finished by the
        # resume (``lifecycle.unfinished_retry``, ``control.opening.finish_retry``): it saves the recorded
        # values, which applied twice change nothing, and never decides the retry again, so the
        # iteration reruns once with the recorded scale and learning rate (never multiplied twice).
        retry = record_retry(run, k, attempt, changes,
                             t.retry_kl_coef_multiplier if cfg.algorithm.use_kl_in_reward else 1.0)
        fault_point("retry:before_config")  # kill tests: the retry recorded, its config changes not saved yet
        save_config(run, apply_overrides(cfg, overrides))
        scaled = retry.scale != retry.scale_before
        shown = {**changes, **({f"iter_{k}/retry.json {RETRY_SCALE}": (retry.scale_before, retry.scale)} if scaled else {})}
        run.append_event("retry", k, attempt=attempt, changes=shown, retry_id=retry.id)
        text = ", ".join(f"{key} {old:.3g} → {new:.3g}" for key, (old, new) in shown.items()) or "no change"
        emit_alert(run, "rollback", k, f"{alert}; retrying ({text})", attempt=attempt, decision="retry")
        log.warning("retrying iteration %d (%d of at most %d): %s", k, attempt, t.max_rollbacks, text)
        outcome = {"action": "retry", "overrides": overrides, "changes": shown}
    else:
        reason = ("trainer.on_kl_breach=halt" if t.on_kl_breach == "halt"
                  else f"trainer.max_rollbacks={t.max_rollbacks} retries used")
        outcome = {"action": "halt", "message": halt_message(run, k, reason)}
        run.append_event("halt", k, reason=reason)
        emit_alert(run, "rollback", k, alert, attempt=attempt, decision="halt")
        emit_alert(run, "halt", k, outcome["message"], reason=reason)
    prefect_artifacts.markdown(
        f"## KL rollback — iteration {k}, attempt {attempt}\n\n{alert}\n\n"
        f"- decision: **{outcome['action']}**\n"
        + (f"- changes: {outcome['changes']}\n" if outcome["action"] == "retry" else f"- {outcome['message']}\n")
        + "".join(f"\n{prefect_artifacts.stage_markdown(r)}\n" for r in stage_results or []),
        key=prefect_artifacts.artifact_key(run, "kl-rollback"), description=f"KL rollback at iteration {k}")
    return outcome
