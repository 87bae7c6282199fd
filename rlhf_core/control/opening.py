"""Opening a planned run under its lock: a new run's directory stamped and its config saved; a
resume's directory cleaned, upgraded, repaired and its unfinished retry finished before the flow
goes on (``open_run``).

Apart from ``control.plan`` on purpose: the plan is what `rlhf run` checks before it loads Prefect,
MLflow and the model libraries (a mistake is one line within seconds); opening a resume rebuilds
damaged artifacts with their producers (``stages.repair``), which need those libraries.
"""

from __future__ import annotations

import shutil

from rlhf_core.config import RLHFConfig, apply_overrides, flatten, to_yaml
from rlhf_core.notes import say_once
from rlhf_core.errors import RLHFError
from rlhf_core.control.plan import RunPlan, never_trained, resume_point, saved_config, upgrade_format
from rlhf_core.io.atomic import clean_temporaries
from rlhf_core.run.layout import RunDir, write_config
from rlhf_core.run.lifecycle import committed_iterations, prune_checkpoints, rebuild_commit_log, unfinished_retry
from rlhf_core.run.migrate import stamp
from rlhf_core.run.report import iteration_metrics
from rlhf_core.stages.repair import rebuild_last_good, repair_run
from rlhf_core.training.run_dtype import keep_recorded_dtype


def start_afresh(run: RunDir) -> bool:
    """Under the run lock: empty a ``never_trained`` directory (its lock files stay) for a new run of
    that name; False when there was nothing to empty. A directory that trained meanwhile is refused."""
    leftovers = [p for p in run.root.iterdir() if not p.name.startswith(run.lock_path.name)]
    if not leftovers:
        return False
    if not never_trained(run):
        raise RLHFError(f"run directory {run.root} already exists; pick another run name or resume it with "
                        f"`rlhf run --resume {run.root}`")
    for p in leftovers:
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    return True


def open_run(plan: RunPlan) -> None:
    """Save the run's config (a resume's overrides included) and note a resume in the event log."""
    plan.run.root.mkdir(parents=True, exist_ok=True)
    retry = None
    if plan.resumed:
        repaired = prepare_resume(plan.run)
        keep_recorded_dtype(plan.cfg, plan.run)
        plan.first_iteration = resume_point(plan.run)
        retry = unfinished_retry(plan.run, plan.first_iteration)
        if retry is not None:  # killed between the retry's record and its config write (tasks.breach)
            plan.cfg, finished = finish_retry(plan.cfg, retry)
            repaired["finished_retry"] = finished
        plan.run.append_event("resume", plan.first_iteration, **repaired,
                              closed=close_committed(plan.cfg, plan.run))
    else:
        if start_afresh(plan.run):
            say_once(f"run directory {plan.run.root}: its earlier run stopped before its first iteration; "
                     "started afresh")
        stamp(plan.run)
    write_config(plan.run, to_yaml(plan.cfg))
    if retry is not None:  # its changes are saved now: the retry is finished, never decided again
        plan.run.append_event("retry", plan.first_iteration, attempt=retry.get("attempt"),
                              changes=retry.get("changes") or {}, retry_id=retry["id"], finished_by="resume")


def finish_retry(cfg: RLHFConfig, record: dict) -> tuple[RLHFConfig, list[str]]:
    """``cfg`` with an unfinished retry's config changes applied, each where ``cfg`` still holds the
    value the retry changed (a key the resume's command line set keeps that value); and the overrides
    applied. Applying them again changes nothing, so a kill before the resume's event is harmless."""
    flat = flatten(cfg)
    overrides = []
    for key, pair in (record.get("changes") or {}).items():
        if isinstance(pair, list) and len(pair) == 2 and key in flat and flat[key] == pair[0]:
            overrides.append(f"{key}={pair[1]!r}")
    return (apply_overrides(cfg, overrides) if overrides else cfg), overrides


def prepare_resume(run: RunDir) -> dict:
    """Before a resume continues, under the run lock: leftovers of interrupted writes removed, the
    directory upgraded to the current format, a lost or damaged commit log rebuilt from the guard
    verdicts, and every damaged artifact of the committed lineage rebuilt by its producer or fallen
    back from (``stages.repair``), each said in one line. Returns what was done, for the resume event."""
    removed = clean_temporaries(run.root)
    saved = saved_config(run)
    migrated = upgrade_format(run, saved)
    rebuilt = rebuild_commit_log(run)
    repairs = repair_run(run, saved) + rebuild_last_good(run)
    return {"cleaned": [str(p) for p in removed], "migrated": migrated, "rebuilt_commit_log": rebuilt,
            "repairs": repairs}


def close_committed(cfg: RLHFConfig, run: RunDir) -> list[int]:
    """What a commit implies, redone for every committed iteration a crash left without it (a kill
    right after the commit's rename): its commit event, its iteration metrics, then the checkpoint
    pruning. Returns the iterations whose metrics were written."""
    committed = committed_iterations(run)
    noted = {e.get("iteration") for e in run.events() if e.get("kind") == "commit"}
    for k in committed:
        if k not in noted:
            run.append_event("commit", k, recovered=True)
    unreported = [k for k in committed if not run.iteration_metrics(k).is_file()]
    for k in unreported:
        iteration_metrics(cfg.data, run, k)
    prune_checkpoints(cfg.trainer, run)
    return unreported
