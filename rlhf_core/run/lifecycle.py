"""The lifecycle of a run's iterations: begin, commit, roll back, retry, halt, resume, fall back,
prune — and the KL controller's state. The only module that writes last_good.json, kl_ctrl.json
and the KL snapshots; stages and flows ask it, never decide a commit themselves.

    begin(k)        snapshot the KL controller before k (once); after a crash inside gae, put it back
    settle(k)       act on the guard's verdict: commit, or roll back
    commit(k)       ONE atomic rename of last_good.json, the commit log (below)
    roll back(k)    mark gae/update/guard rolled_back (one manifest write), restore the KL
                    controller, discard k's checkpoint, append the event; every step idempotent
    retry / halt    after a rollback, ``trainer.on_kl_breach`` (the overrides, the message)
    resume          clean temporaries, rebuild a lost commit log, verify last-good (fall back to the
                    newest intact commit), prune
    prune           committed checkpoints that are neither last-good nor kept save points

Durable and replayable. With resident models (``trainer.resident_models``) most committed iterations
have no checkpoint directory: the update keeps their state in memory and writes a full checkpoint
every ``trainer.save_freq`` iterations and at the end. Such an iteration is *replayable*: its
``iter_k/state.json`` (what it started from, the config it trained with) and its advantages table
are on disk, so ``training.resident`` rebuilds its state bit for bit from the newest checkpoint
before it. A commit needs the state to exist in one of the two forms; the commit log stays the one
record of what is committed.

"Committed" is stored once, in the commit log ``last_good.json``::

    {"iteration": k, "checkpoint": "iter_k/checkpoint", "time": t, "committed": [1, 2, ..., k]}

The last entry is last-good. A commit is one atomic rename of that file, so a kill at any
instruction of it leaves either the old log or the new one; everything that follows from a commit
(iteration metrics, MLflow step, pruning) is recomputed from the log when missing, so a kill after
the rename loses nothing either. A damaged or deleted log is rebuilt from the guard verdicts on
disk at resume (one warning line), never silently restarted from iteration 1.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Optional

from rlhf_core.config import RLHFConfig
from rlhf_core.errors import CheckpointError, RLHFError
from rlhf_core.io.atomic import TMP_MARK, atomic_write_json, clean_temporaries
from rlhf_core.run.layout import RunDir, StateFileError
from rlhf_core.run.lock import RunLock
from rlhf_core.run.manifest import read_manifest, write_manifest
from rlhf_core.run.schedule import save_due
from rlhf_core.stages.registry import ROLLED_BACK_STAGES
from rlhf_core.io.checksums import verify_checkpoint


class KLGuardHalt(RLHFError):
    """The guard rolled back an iteration and the policy (halt, or retries used up) stops the run."""


# ---------------------------------------------------------------------------------------------
# the commit log
# ---------------------------------------------------------------------------------------------


def read_last_good(run: RunDir) -> Optional[dict]:
    """The commit log (see the module docstring), or None before any commit. A file that is not a
    commit log raises ``StateFileError`` naming it and the repair (``rlhf run --resume`` rebuilds it)."""
    try:
        record = run.read_json(run.last_good_path)
    except StateFileError as exc:
        raise StateFileError(f"{exc}; `rlhf run --resume {run.root}` rebuilds it from the guard verdicts") from None
    if record is None:
        return None
    if not _is_commit_log(record):
        raise StateFileError(f"{run.last_good_path} is not a commit log (expected {{\"iteration\": K, "
                             f"\"checkpoint\": ..., \"committed\": [...]}}); `rlhf run --resume {run.root}` "
                             "rebuilds it from the guard verdicts")
    if "committed" not in record:  # a run directory from before the commit log: the manifests said it
        record = {**record, "committed": _legacy_committed(run, int(record["iteration"]))}
    return record


def _is_commit_log(record: Any) -> bool:
    return (isinstance(record, dict) and isinstance(record.get("iteration"), int)
            and isinstance(record.get("checkpoint"), str)
            and all(isinstance(k, int) for k in record.get("committed", [record.get("iteration")])))


def _legacy_committed(run: RunDir, last_good: int) -> list[int]:
    return [k for k in run.iterations() if k < last_good and read_manifest(run, k).get("guard", {}).get("committed")
            ] + [last_good]


def committed_iterations(run: RunDir) -> list[int]:
    """Iterations the guard committed, ascending (from the commit log alone)."""
    record = read_last_good(run)
    return list(record["committed"]) if record else []


def last_good_iteration(run: RunDir) -> int:
    """The last committed iteration (0 before any commit)."""
    record = read_last_good(run)
    return int(record["iteration"]) if record else 0


def require_reachable(run: RunDir, stage: str, iteration: Optional[int]) -> None:
    """Refuse a stage rerun of an iteration the run has not reached: a per-iteration stage runs on
    iterations 1 .. last-good + 1 (the next one), validate on 0 .. last-good; anything later would
    write a stray iter_K built on a state that iteration never starts from."""
    if iteration is None:
        return
    last_good = last_good_iteration(run)
    latest = last_good if stage == "validate" else last_good + 1
    if iteration > latest:
        reach = "validates committed iterations" if stage == "validate" else "reruns iterations up to the next one"
        raise RLHFError(f"{run.root} has not reached iteration {iteration}: last-good is {last_good}, and `rlhf stage "
                        f"{stage}` {reach} (<= {latest}); `rlhf run --resume {run.root} --iterations N` trains on")


def _write_log(run: RunDir, committed: list[int]) -> Optional[dict]:
    if not committed:
        run.last_good_path.unlink(missing_ok=True)
        return None
    k = committed[-1]
    record = {"iteration": k, "checkpoint": str(run.checkpoint(k).relative_to(run.root)), "time": time.time(),
              "committed": committed}
    atomic_write_json(run.last_good_path, record)
    return record


def last_good_checkpoint(run: RunDir) -> Optional[Path]:
    record = read_last_good(run)
    return run.root / record["checkpoint"] if record else None


def is_replayable(run: RunDir, k: int) -> bool:
    """Iteration ``k``'s state can be rebuilt without its checkpoint: its state record and the
    advantages table its update trained on are on disk (``training.resident`` replays it)."""
    return run.state_record(k).is_file() and run.advantages(k).is_file()


def state_exists(run: RunDir, k: int) -> bool:
    """Iteration ``k``'s state is on disk as a checkpoint, or can be rebuilt (``is_replayable``)."""
    return (run.checkpoint(k) / "actor").is_dir() or is_replayable(run, k)


def newest_durable(run: RunDir, through: int) -> int:
    """The newest committed iteration at or before ``through`` whose checkpoint directory is on disk
    (0: none, the initial models). Existence only: ``verified_last_good`` checks the contents at resume."""
    for k in reversed([k for k in committed_iterations(run) if k <= through]):
        if (run.checkpoint(k) / "actor").is_dir():
            return k
    return 0


def checkpoint_before(run: RunDir, iteration: int) -> Optional[Path]:
    """The checkpoint iteration ``iteration`` started from: that of the latest earlier committed
    iteration (None: the initial models). While the pipeline moves forward this is the last-good
    checkpoint; for a rerun of an old iteration it is the one that iteration really used, so
    `rlhf stage score --iteration 1` after iteration 2 committed still scores with the initial actor."""
    earlier = [k for k in committed_iterations(run) if k < iteration]
    if not earlier:
        return None
    ckpt = run.checkpoint(earlier[-1])
    if not state_exists(run, earlier[-1]):
        raise CheckpointError(
            f"iteration {iteration} started from {ckpt}, which was pruned (checkpoints are kept every "
            f"trainer.save_freq iterations and for last-good); rerun that iteration's stages only when "
            f"its starting checkpoint is kept")
    return ckpt


def policy_after(run: RunDir, k: int) -> Optional[Path]:
    """The checkpoint holding the policy as it was after step ``k``: the latest commit at or before
    ``k`` (None: the initial models). What validation after step k measures."""
    return checkpoint_before(run, k + 1)


# ---------------------------------------------------------------------------------------------
# begin / KL controller state
# ---------------------------------------------------------------------------------------------


def kl_state(run: RunDir) -> Optional[dict]:
    """The KL controller's current state (None: fresh, from the config). A damaged kl_ctrl.json
    falls back to the last-good checkpoint's copy, with one warning line and an event."""
    try:
        state = run.read_json(run.kl_ctrl_path)
    except StateFileError as exc:
        state = _kl_state_from_last_good(run)
        _warn(run, "kl_ctrl_fallback", f"{exc}; using the last-good checkpoint's KL controller state "
                                       f"({'value ' + repr(state.get('value')) if state else 'fresh from the config'})")
        write_kl_state(run, state)
        return state
    if state is not None and not (isinstance(state, dict) and isinstance(state.get("value"), (int, float))):
        raise StateFileError(f"{run.kl_ctrl_path} holds {state!r}, not a KL controller state (a \"value\"); delete it "
                             "to restart the coefficient at algorithm.kl_ctrl.kl_coef")
    return state


def write_kl_state(run: RunDir, state: Optional[dict]) -> None:
    """The one writer of kl_ctrl.json (None removes it: a fresh controller)."""
    if state is None:
        run.kl_ctrl_path.unlink(missing_ok=True)
    else:
        atomic_write_json(run.kl_ctrl_path, state)


def write_kl_snapshot(run: RunDir, k: int, state: Optional[dict]) -> None:
    """The one writer of iter_k/kl_ctrl_before.json: the state iteration ``k`` starts from."""
    atomic_write_json(run.kl_snapshot(k), {"state": state})


def take_kl_snapshot(run: RunDir, k: int) -> bool:
    """Record the current state as the state before iteration ``k``, unless already recorded."""
    if run.kl_snapshot(k).is_file():
        return False
    write_kl_snapshot(run, k, kl_state(run))
    return True


def kl_state_before(run: RunDir, k: int) -> Optional[dict]:
    """The controller state iteration ``k`` starts from (None: a fresh controller from the config)."""
    snapshot = run.kl_snapshot(k)
    record = run.read_json(snapshot)
    if not isinstance(record, dict) or "state" not in record:
        raise StateFileError(f"{snapshot} is not a KL controller snapshot (expected {{\"state\": ...}}); delete it to "
                             f"start iteration {k} from {run.kl_ctrl_path}")
    return record["state"]


def later_started_iteration(run: RunDir, k: int) -> Optional[int]:
    """The first iteration after ``k`` that already took its KL snapshot (started from kl_ctrl.json)."""
    return next((j for j in run.iterations() if j > k and run.kl_snapshot(j).is_file()), None)


def persist_kl_controller(run: RunDir, k: int, state: dict) -> Optional[int]:
    """After gae of ``k`` stepped the controller: write its state, unless a later iteration already
    started from the file (a rerun of an old iteration must not rewind the run's controller).
    Returns that later iteration, or None when written."""
    later = later_started_iteration(run, k)
    if later is None:
        write_kl_state(run, state)
    return later


def begin_iteration(run: RunDir, k: int) -> dict:
    """Record the KL controller state as it was before iteration ``k`` (once), and when the gae
    stage of ``k`` has not completed, put that state back: a crash inside gae may have updated the
    controller without recording the stage, and rerunning gae must not update it twice."""
    current = kl_state(run)
    if not run.kl_snapshot(k).is_file():
        write_kl_snapshot(run, k, current)
        return {"snapshot": "taken", "state": current}
    saved = kl_state_before(run, k)
    gae_done = read_manifest(run, k).get("gae", {}).get("status") == "done"
    if not gae_done and saved != current:
        write_kl_state(run, saved)
        return {"snapshot": "restored", "state": saved}
    return {"snapshot": "kept", "state": current}


def restore_kl_controller(run: RunDir, k: int) -> Optional[dict]:
    """Put kl_ctrl.json back to its state before iteration ``k`` (from the snapshot, else from the
    last-good checkpoint's trainer_state.json). Returns the restored state (None = fresh)."""
    state = kl_state_before(run, k) if run.kl_snapshot(k).is_file() else _kl_state_from_last_good(run)
    write_kl_state(run, state)
    return state


def _kl_state_from_last_good(run: RunDir) -> Optional[dict]:
    return _kl_state_in(run, last_good_checkpoint(run))


def _kl_state_in(run: RunDir, ckpt: Optional[Path]) -> Optional[dict]:
    """The KL controller state a checkpoint saved, or its state record when the checkpoint is not on
    disk (None: no checkpoint, or none readable)."""
    if ckpt is None:
        return None
    k = run.checkpoint_iteration(ckpt)
    try:
        if not (ckpt / "trainer_state.json").is_file() and k is not None:
            return (run.read_json(run.state_record(k)) or {}).get("kl_ctrl")
        return (run.read_json(ckpt / "trainer_state.json") or {}).get("kl_ctrl")
    except StateFileError:
        return None


# ---------------------------------------------------------------------------------------------
# settle: commit or roll back
# ---------------------------------------------------------------------------------------------


def read_verdict(run: RunDir, k: int) -> Optional[dict]:
    return run.read_json(run.verdict(k))


def settle(run: RunDir, k: int, *, policy: str, attempt: int) -> str:
    """Act on iteration ``k``'s guard verdict: "commit" or "rollback" (what was done)."""
    verdict = read_verdict(run, k)
    if not verdict or verdict.get("decision") not in ("commit", "rollback"):
        raise CheckpointError(f"iteration {k} of {run.root} has no guard verdict ({run.verdict(k)}): run "
                              f"`rlhf stage guard --run-dir {run.root} --iteration {k}` first")
    if verdict["decision"] == "commit":
        commit_iteration(run, k)
        return "commit"
    rollback_iteration(run, k, policy=policy, attempt=attempt)
    return "rollback"


def commit_iteration(run: RunDir, k: int) -> dict:
    """Append ``k`` to the commit log (one atomic rename: last-good moves to ``k``), then note it
    in the event log. Idempotent: committing a committed iteration changes nothing."""
    RunLock(run).ensure_held()  # a writer whose lease another machine took over must not move last-good
    checkpoint = run.checkpoint(k)
    if not state_exists(run, k):
        raise CheckpointError(f"cannot commit iteration {k}: {checkpoint}/actor is missing and "
                              f"{run.state_record(k)} does not say how to rebuild it")
    previous = read_last_good(run)
    committed = list(previous["committed"]) if previous else []
    if k in committed:
        return previous
    if committed and k < committed[-1]:
        raise CheckpointError(f"cannot commit iteration {k}: iteration {committed[-1]} is already committed after it")
    record = _write_log(run, committed + [k])
    run.append_event("commit", k, previous_last_good=committed[-1] if committed else None)
    return record


def discard_checkpoint(run: RunDir, k: int) -> bool:
    """Remove iteration ``k``'s checkpoint: renamed to a temporary name first (one atomic step, so
    no reader ever sees half a checkpoint; ``clean_temporaries`` removes a crash's leftover), then
    deleted. Refuses to touch the last-good checkpoint. Returns whether anything was removed."""
    checkpoint = run.checkpoint(k)
    if last_good_iteration(run) == k:
        raise CheckpointError(f"refusing to discard {checkpoint}: it is the last-good checkpoint")
    if not checkpoint.exists():
        return False
    doomed = checkpoint.with_name(f"{checkpoint.name}{TMP_MARK}discarded-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    os.replace(checkpoint, doomed)
    shutil.rmtree(doomed, ignore_errors=True)
    return True


def rollback_iteration(run: RunDir, k: int, *, policy: str, attempt: int) -> dict:
    """Undo iteration ``k``: its gae/update/guard records ``rolled_back`` (first: after that, a
    resume redoes them whatever else a crash left), the KL controller back to its state before k,
    the checkpoint discarded, the event appended. Each step is idempotent."""
    if k in committed_iterations(run):
        raise CheckpointError(f"iteration {k} is committed: a committed iteration is never rolled back")
    verdict = read_verdict(run, k) or {}
    manifest = read_manifest(run, k)
    for stage in ROLLED_BACK_STAGES:
        if stage in manifest:
            manifest[stage]["status"] = "rolled_back"
            manifest[stage]["rollback_attempt"] = attempt
    write_manifest(run, k, manifest)
    restored = restore_kl_controller(run, k)
    discard_checkpoint(run, k)
    run.state_record(k).unlink(missing_ok=True)  # the discarded state is nobody's to rebuild
    last_good = read_last_good(run)
    return run.append_event(
        "rollback", k, reason=verdict.get("reason", "KL above threshold"), kl=verdict.get("kl_mean"),
        val_kl=verdict.get("val_kl_mean"), threshold=verdict.get("threshold"), attempt=attempt, policy=policy,
        last_good=last_good.get("iteration") if last_good else None, kl_ctrl_restored=restored)


def rollback_count(run: RunDir, k: int, since: float = 0.0) -> int:
    """Rollbacks of iteration ``k`` recorded since ``since`` (a flow run's start time)."""
    return sum(1 for e in run.events() if e.get("kind") == "rollback" and e.get("iteration") == k
               and e.get("time", 0) >= since)


# ---------------------------------------------------------------------------------------------
# retry / halt
# ---------------------------------------------------------------------------------------------


def retry_overrides(cfg: RLHFConfig, run: RunDir, k: int) -> tuple[list[str], dict[str, Any]]:
    """What a retry of iteration ``k`` changes: the actor learning rate divided by
    trainer.retry_lr_divisor (a config override) and the KL coefficient multiplied by
    trainer.retry_kl_coef_multiplier (in the controller state and its pre-iteration snapshot, so a
    second rollback starts from the raised value). Returns (overrides, {change: (old, new)})."""
    t = cfg.trainer
    changes: dict[str, Any] = {}
    overrides: list[str] = []
    if t.retry_lr_divisor > 1:
        old = cfg.actor_rollout_ref.actor.optim.lr
        overrides.append(f"actor_rollout_ref.actor.optim.lr={old / t.retry_lr_divisor!r}")
        changes["actor_rollout_ref.actor.optim.lr"] = (old, old / t.retry_lr_divisor)
    if t.retry_kl_coef_multiplier > 1:
        state = kl_state(run)
        if state is not None:
            old = float(state["value"])
            state = {**state, "value": old * t.retry_kl_coef_multiplier}
            write_kl_state(run, state)
            write_kl_snapshot(run, k, state)
            changes["kl_ctrl.value"] = (old, state["value"])
        else:  # no controller state yet: the coefficient still comes from the config
            old = cfg.algorithm.kl_ctrl.kl_coef
            overrides.append(f"algorithm.kl_ctrl.kl_coef={old * t.retry_kl_coef_multiplier!r}")
            changes["algorithm.kl_ctrl.kl_coef"] = (old, old * t.retry_kl_coef_multiplier)
        if cfg.actor_rollout_ref.actor.use_kl_loss:
            old = cfg.actor_rollout_ref.actor.kl_loss_coef
            overrides.append(f"actor_rollout_ref.actor.kl_loss_coef={old * t.retry_kl_coef_multiplier!r}")
            changes["actor_rollout_ref.actor.kl_loss_coef"] = (old, old * t.retry_kl_coef_multiplier)
    return overrides, changes


def halt_message(run: RunDir, k: int, reason: str) -> str:
    """What happened and how to continue, for the failed flow run and the CLI."""
    verdict = read_verdict(run, k) or {}
    last_good = read_last_good(run)
    where = f"iteration {last_good['iteration']}" if last_good else "the initial model (no iteration committed)"
    if "reason" in verdict:  # a non-finite update, not a KL breach
        return (f"KL guard halted the run at iteration {k}: {verdict['reason']} ({reason}). The iteration was "
                f"rolled back; last-good is {where}. Look for NaN/inf in iter_{k}/advantages.parquet and the "
                f"update's metrics (iter_{k}/metrics.json), lower actor_rollout_ref.actor.optim.lr or fix the "
                f"reward, then resume: rlhf run --resume {run.root}")
    kl, on_val = verdict.get("kl_mean", float("nan")), verdict.get("val_kl_mean", float("-inf"))
    what = "KL(actor‖ref) on validation prompts" if on_val > kl else "KL(actor‖ref)"
    shown_kl, shown_threshold = shown_apart(max(kl, on_val), verdict.get("threshold", float("nan")))
    return (f"KL guard halted the run at iteration {k}: {what} = {shown_kl} "
            f"> trainer.kl_rollback_threshold = {shown_threshold} ({reason}). The iteration was rolled "
            f"back; last-good is {where}. To continue, lower the step size or raise the threshold and resume, "
            f"e.g.: rlhf run --resume {run.root} actor_rollout_ref.actor.optim.lr=<smaller> "
            f"(or trainer.on_kl_breach=retry, or trainer.kl_rollback_threshold=<larger>)")


def shown_apart(value: float, bound: float) -> tuple[str, str]:
    """``value`` and ``bound`` as text with enough significant digits (4 at least) that two unequal
    numbers never read equal: a KL of 0.000312 over a threshold of 0.0003 printed "0.0003 > 0.0003"."""
    for digits in range(4, 18):
        a, b = f"{value:.{digits}g}", f"{bound:.{digits}g}"
        if a != b or value == bound:
            return a, b
    return repr(value), repr(bound)


def nonfinite_update(update_record: dict, kl: float) -> Optional[str]:
    """Why an iteration's update is not worth keeping although its KL may look fine, else None: a
    non-finite KL, or every actor optimizer step skipped for a non-finite loss / gradient norm (the
    weights did not move; committing would hide the fault). ``update_record``: iter_k/metrics.json."""
    if not math.isfinite(kl):
        return f"KL(actor‖ref) is {kl}"
    metrics = update_record.get("metrics") or {}
    steps, skipped = metrics.get("actor/num_steps", 0), metrics.get("actor/skipped_steps", 0)
    if steps and skipped >= steps:
        return f"all {int(steps)} actor steps skipped (non-finite loss or gradient norm)"
    return None


# ---------------------------------------------------------------------------------------------
# resume / fall back
# ---------------------------------------------------------------------------------------------


def prepare_resume(run: RunDir) -> dict:
    """Before a resume continues: leftovers of interrupted writes removed, a lost or damaged commit
    log rebuilt from the guard verdicts, last-good verified (a damaged or missing checkpoint falls
    back to the newest intact commit). Returns what was done, for the resume event."""
    removed = clean_temporaries(run.root)
    rebuilt = rebuild_commit_log(run)
    fallback = verified_last_good(run)
    return {"cleaned": [str(p) for p in removed], "rebuilt_commit_log": rebuilt,
            "fell_back_from": (fallback or {}).get("fell_back_from")}


def commit_log_problem(run: RunDir) -> Optional[str]:
    """Why the commit log cannot be trusted (damaged, or missing while iterations committed by
    their verdicts are on disk), else None. Writes nothing."""
    try:
        record = read_last_good(run)
    except StateFileError as exc:
        return str(exc)
    evident = _committed_by_verdicts(run)
    if record is None and evident:
        return (f"{run.last_good_path} is missing but iterations {evident} passed the guard; "
                f"`rlhf run --resume {run.root}` rebuilds it")
    if record is not None and record["iteration"] not in run.iterations():
        return f"{run.last_good_path} names iteration {record['iteration']}, which is not on disk"
    return None


def _committed_by_verdicts(run: RunDir) -> list[int]:
    """Iterations whose guard record is done with a commit verdict and whose checkpoint is still on
    disk or was pruned after the commit, in order, up to the first gap (a commit needs its predecessor)."""
    out = []
    for k in (k for k in run.iterations() if k >= 1):  # iter_0 holds only the initial validation
        guard = read_manifest(run, k).get("guard", {})
        try:
            verdict = read_verdict(run, k) or {}
        except StateFileError:
            break
        if guard.get("status") != "done" or verdict.get("decision") != "commit":
            break
        if not state_exists(run, k) and not read_manifest(run, k).get("update", {}).get("checkpoint_pruned"):
            break
        out.append(k)
    return out


def rebuild_commit_log(run: RunDir) -> Optional[list[int]]:
    """When the commit log is damaged, or missing although verdicts committed iterations, write it
    again from the verdicts (one warning line and an event). Returns the rebuilt list, or None."""
    try:
        record = read_last_good(run)
    except StateFileError as exc:
        record, why = None, str(exc)
    else:
        if record is not None:
            return None
        why = f"{run.last_good_path} is missing"
    committed = _committed_by_verdicts(run)
    if not committed and "missing" in why:
        return None  # nothing was ever committed: a fresh commit log is the right one
    _write_log(run, committed)
    _warn(run, "commit_log_rebuilt", f"{why}; rebuilt it from the guard verdicts: committed {committed or 'none'}")
    return committed


def verified_last_good(run: RunDir) -> Optional[dict]:
    """The commit log after checking the last-good checkpoint against its sha256 manifest; when that
    checkpoint is damaged or missing, fall back to the newest earlier committed checkpoint that
    verifies.

    A fallback from iteration b to g (< b) puts the run back as if g were the last commit: the
    gae/update/guard records of g+1..b become ``stale`` (they rerun; rollout and score stay valid,
    they started from g's models), the KL controller returns to its state before g+1, the commit
    log is cut after g (one atomic write), and a ``checkpoint_corrupt_fallback`` event and a stderr
    line say so. Each step is idempotent, so a crash in between is repaired by resuming again.
    A missing last-good directory is damaged, never "pruned". Raises ``CheckpointError`` naming
    every damaged file when no committed checkpoint verifies and some earlier ones are gone (pruned,
    or deleted by hand); when every commit is there but damaged, the run falls back to the initial
    models.
    """
    record = read_last_good(run)
    if not record:
        return record
    committed = list(record["committed"])
    errors: list[str] = []
    damaged: set[int] = set()
    unavailable = 0  # pruned, or deleted by hand: not damaged, but nothing to fall back to either
    for k in reversed(committed):
        ckpt = run.checkpoint(k)
        if not ckpt.is_dir():
            if is_replayable(run, k):
                continue  # not durable: rebuilt by replay from the checkpoint found below
            if k != committed[-1]:
                unavailable += 1
                continue
            errors.append(f"iteration {k}: {ckpt} is missing")  # last-good itself: never "pruned"
            damaged.add(k)
            continue
        try:
            verify_checkpoint(ckpt)
        except CheckpointError as exc:
            errors.append(f"iteration {k}: {exc}")
            damaged.add(k)
            continue
        return _keep_or_fall_back(run, record, committed, k, damaged, errors)
    if not unavailable:  # no commit verifies: start again from the initial models (and replay what can be)
        return _keep_or_fall_back(run, record, committed, 0, damaged, errors)
    raise CheckpointError(
        f"no committed checkpoint of {run.root} verifies:\n  " + "\n  ".join(errors or ["(none kept)"])
        + f"\n({unavailable} earlier commit(s) pruned or deleted); keep more checkpoints (trainer.save_freq=1, "
        "trainer.max_ckpt_to_keep>=2) or start a new run")


def _keep_or_fall_back(run: RunDir, record: dict, committed: list[int], base: int, damaged: set[int],
                       errors: list[str]) -> dict:
    """From the intact checkpoint of ``base`` (0: the initial models), the commits after it that can
    be replayed in order — none damaged, each with its state record — are kept; the run falls back to
    the last of them when that is not last-good."""
    good = base
    for j in (j for j in committed if j > base):
        if j in damaged or not is_replayable(run, j):
            break
        good = j
    if good == committed[-1]:
        return record
    return _fall_back(run, committed, good, errors)


def _fall_back(run: RunDir, committed: list[int], good: int, errors: list[str]) -> dict:
    bad = committed[-1]
    on_disk = set(run.iterations())
    for j in range(good + 1, bad + 1):  # undo the commits after ``good``: they rerun from its models
        if j not in on_disk:
            continue
        manifest = read_manifest(run, j)
        for stage in ROLLED_BACK_STAGES:
            if stage in manifest:
                manifest[stage]["status"] = "stale"
        if "guard" in manifest:
            manifest["guard"]["checkpoint_corrupt"] = any(e.startswith(f"iteration {j}:") for e in errors)
        write_manifest(run, j, manifest)
    write_kl_state(run, _kl_state_after(run, good))
    record = _write_log(run, [k for k in committed if k <= good]) or {"iteration": 0, "checkpoint": None,
                                                                       "committed": []}
    target = f"the checkpoint of iteration {good}" if good else "the initial models (no checkpoint verifies)"
    message = (f"last-good checkpoint of iteration {bad} is damaged ({errors[0].split(': ', 1)[1]}); falling back "
               f"to {target}: iterations {good + 1}..{bad} will be rerun")
    run.append_event("checkpoint_corrupt_fallback", good, corrupt_iteration=bad, errors=errors, message=message)
    print(f"rlhf: warning: {message}", file=sys.stderr)
    return {**record, "fell_back_from": bad, "message": message}


def _kl_state_after(run: RunDir, good: int) -> Optional[dict]:
    """The KL controller state the iteration after ``good`` starts from: its snapshot when it took
    one, else the state saved in ``good``'s checkpoint (None: fresh, before any commit)."""
    if run.kl_snapshot(good + 1).is_file():
        return kl_state_before(run, good + 1)
    return _kl_state_in(run, run.checkpoint(good) if good else None)


def _warn(run: RunDir, kind: str, message: str) -> None:
    run.append_event(kind, None, message=message)
    print(f"rlhf: warning: {message}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# prune
# ---------------------------------------------------------------------------------------------


def prune_checkpoints(cfg: RLHFConfig, run: RunDir) -> list[int]:
    """Delete committed checkpoints that are neither last-good nor among the last
    trainer.max_ckpt_to_keep save points; note it in the update record. Returns the iterations."""
    committed = committed_iterations(run)
    save_points = [k for k in committed if save_due(cfg, k)]
    keep = set(save_points[-cfg.trainer.max_ckpt_to_keep:] if cfg.trainer.max_ckpt_to_keep > 0 else [])
    keep.add(committed[-1] if committed else None)
    keep.add(newest_durable(run, committed[-1]) if committed else None)  # what a replay starts from
    removed = []
    for k in committed:
        if k in keep or not run.checkpoint(k).exists():
            continue
        manifest = read_manifest(run, k)
        if "update" in manifest:  # first: a kill after it leaves a checkpoint that the next prune removes
            manifest["update"]["checkpoint_pruned"] = True
            write_manifest(run, k, manifest)
        discard_checkpoint(run, k)
        removed.append(k)
    return removed
