"""The lifecycle of a run's iterations: commit, roll back, retry, halt, fall back, prune. The only
module that writes last_good.json; stages and flows ask it, never decide a commit themselves.

    settle(k)       act on the guard's verdict: commit, or roll back
    commit(k)       ONE atomic rename of last_good.json, the commit log (below)
    roll back(k)    mark gae/update/guard rolled_back (one manifest write), discard k's checkpoint
                    and state record, append the event; every step idempotent. Nothing else: the
                    KL controller's state is an output of gae (``stages.gae``), and a retry's gae
                    starts again from the committed predecessor's
    retry / halt    after a rollback, ``trainer.on_kl_breach``: the retry's decision is recorded in
                    iter_k/retry.json (``record_retry``: the scale of the reward's KL coefficient,
                    an input of k's gae), then its config overrides (``retry_overrides``: learning
                    rate, kl_loss_coef) saved in one write of config.yaml; or the message
    fall back(g)    what cannot be rebuilt ends the lineage: the commit log is cut after g
                    (``stages.repair`` decides, ``run.integrity`` finds what is damaged)
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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from rlhf_core.errors import CheckpointError, DataError, RLHFError
from rlhf_core.io.atomic import TMP_MARK, atomic_write_json
from rlhf_core.run.layout import RunDir, StateFileError
from rlhf_core.run.lock import RunLock
from rlhf_core.run.manifest import path_digest, read_manifest, record_key, write_manifest
from rlhf_core.run.schedule import save_due
from rlhf_core.run.stage_order import ROLLED_BACK_STAGES

if TYPE_CHECKING:  # annotations only: reading the commit log (`rlhf query`) does not load the config's schema
    from rlhf_core.config import RLHFConfig
    from rlhf_core.config.schema import TrainerConfig


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
    return record


def _is_commit_log(record: Any) -> bool:
    return (isinstance(record, dict) and isinstance(record.get("iteration"), int)
            and isinstance(record.get("checkpoint"), str) and isinstance(record.get("committed"), list)
            and all(isinstance(k, int) for k in record["committed"]))


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
    (0: none, the initial models). Existence only: ``run.integrity`` checks the contents at resume."""
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


def discard_checkpoint(run: RunDir, k: int, *, damaged: bool = False) -> bool:
    """Remove iteration ``k``'s checkpoint: renamed to a temporary name first (one atomic step, so
    no reader ever sees half a checkpoint; ``clean_temporaries`` removes a crash's leftover), then
    deleted. Refuses to touch the last-good checkpoint unless it is ``damaged`` (its state is then
    rebuilt by replay from its record). Returns whether anything was removed."""
    checkpoint = run.checkpoint(k)
    if last_good_iteration(run) == k and not damaged:
        raise CheckpointError(f"refusing to discard {checkpoint}: it is the last-good checkpoint")
    if not checkpoint.exists() and not checkpoint.is_symlink():
        return False
    doomed = checkpoint.with_name(f"{checkpoint.name}{TMP_MARK}discarded-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    os.replace(checkpoint, doomed)
    if doomed.is_symlink():  # the link goes, never what it points at (another run's checkpoint)
        doomed.unlink()
    else:
        shutil.rmtree(doomed, ignore_errors=True)
    return True


def rollback_iteration(run: RunDir, k: int, *, policy: str, attempt: int) -> dict:
    """Undo iteration ``k``: its gae/update/guard records ``rolled_back`` (first: after that, a
    resume redoes them whatever else a crash left), the checkpoint discarded, the event appended.
    Each step is idempotent. The KL controller needs nothing: its state is gae's output, and the
    retry's gae starts again from the committed predecessor's."""
    if k in committed_iterations(run):
        raise CheckpointError(f"iteration {k} is committed: a committed iteration is never rolled back")
    verdict = read_verdict(run, k) or {}
    manifest = read_manifest(run, k)
    for stage in ROLLED_BACK_STAGES:
        if stage in manifest:
            manifest[stage]["status"] = "rolled_back"
            manifest[stage]["rollback_attempt"] = attempt
    write_manifest(run, k, manifest)
    discard_checkpoint(run, k)
    run.state_record(k).unlink(missing_ok=True)  # the discarded state is nobody's to rebuild
    last_good = read_last_good(run)
    return run.append_event(
        "rollback", k, reason=verdict.get("reason", "KL above threshold"), kl=verdict.get("kl_mean"),
        val_kl=verdict.get("val_kl_mean"), threshold=verdict.get("threshold"), attempt=attempt, policy=policy,
        last_good=last_good.get("iteration") if last_good else None)


def rollback_count(run: RunDir, k: int, since: float = 0.0) -> int:
    """Rollbacks of iteration ``k`` recorded since ``since`` (a flow run's start time)."""
    return sum(1 for e in run.events() if e.get("kind") == "rollback" and e.get("iteration") == k
               and e.get("time", 0) >= since)


# ---------------------------------------------------------------------------------------------
# retry / halt
# ---------------------------------------------------------------------------------------------


def retry_overrides(cfg: RLHFConfig) -> tuple[list[str], dict[str, Any]]:
    """What a retry changes in the config, as overrides the caller saves in one write of config.yaml:
    the actor learning rate divided by trainer.retry_lr_divisor, the loss's KL coefficient
    (actor.kl_loss_coef) multiplied by trainer.retry_kl_coef_multiplier. The reward's KL coefficient
    is not config: ``record_retry`` scales it for the iteration. Returns (overrides, {key: (old, new)})."""
    t = cfg.trainer
    changes: dict[str, Any] = {}
    if t.retry_lr_divisor > 1:
        old = cfg.actor_rollout_ref.actor.optim.lr
        changes["actor_rollout_ref.actor.optim.lr"] = (old, old / t.retry_lr_divisor)
    if t.retry_kl_coef_multiplier > 1 and cfg.actor_rollout_ref.actor.use_kl_loss:
        old = cfg.actor_rollout_ref.actor.kl_loss_coef
        changes["actor_rollout_ref.actor.kl_loss_coef"] = (old, old * t.retry_kl_coef_multiplier)
    return [f"{key}={new!r}" for key, (_, new) in changes.items()], changes


RETRY_SCALE = "kl_coef_scale"
"""The field of iter_k/retry.json that scales the reward's KL coefficient of iteration k."""


def read_retry_scale(run: RunDir, k: int) -> float:
    """The scale a retry set for iteration ``k``'s reward KL coefficient (``iter_k/retry.json``), 1
    when no retry of ``k`` recorded one. A damaged file raises ``StateFileError`` naming it."""
    record = run.read_json(run.retry_record(k))
    if record is None:
        return 1.0
    scale = record.get(RETRY_SCALE)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise StateFileError(f"{run.retry_record(k)} is damaged (its {RETRY_SCALE!r} is {scale!r}, not a number > 0); "
                             f"delete it to run iteration {k} with the controller's own KL coefficient")
    return float(scale)


def retries_recorded(run: RunDir, k: int) -> int:
    """How many retries of iteration ``k`` were decided (``iter_k/retry.json``'s "attempt", 0 when
    none): the attempt count lives with the iteration, so a kill during a retry grants none anew.
    A damaged file raises ``StateFileError`` naming it."""
    record = run.read_json(run.retry_record(k))
    if record is None:
        return 0
    attempt = record.get("attempt")
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 1:
        raise StateFileError(f"{run.retry_record(k)} is damaged (its 'attempt' is {attempt!r}, not a count >= 1); "
                             f"delete it to run iteration {k} with the controller's own KL coefficient")
    return attempt


@dataclass(frozen=True)
class RetryRecord:
    """What ``record_retry`` wrote: the reward KL coefficient's scale before and after, and the id
    the "retry" event repeats."""

    scale_before: float
    scale: float
    id: str


def record_retry(run: RunDir, k: int, attempt: int, changes: dict[str, Any], multiplier: float) -> RetryRecord:
    """Write iteration ``k``'s retry decision, atomically, in ``iter_k/retry.json``: {"attempt",
    "kl_coef_scale": the previous retry's scale of ``k`` (1 for the first) times ``multiplier``
    (trainer.retry_kl_coef_multiplier with the KL in the reward, else 1), "changes": the
    config overrides of ``retry_overrides`` (``changes``: {key: (old, new)}), "id"}. The caller then
    saves those overrides in config.yaml and appends the "retry" event with that id: a kill between
    the two is finished by the resume (``unfinished_retry``, ``control.opening.finish_retry``).
    Returns what it wrote."""
    old = read_retry_scale(run, k)
    new = old * multiplier
    record_id = uuid.uuid4().hex
    atomic_write_json(run.retry_record(k), {"iteration": k, "attempt": attempt, RETRY_SCALE: new,
                                            "changes": {key: list(pair) for key, pair in changes.items()},
                                            "id": record_id})
    return RetryRecord(old, new, record_id)


def unfinished_retry(run: RunDir, k: int) -> Optional[dict]:
    """Iteration ``k``'s retry record when its config changes may not be in config.yaml yet (a kill
    after ``record_retry`` and before the "retry" event that follows the config write), else None."""
    try:
        record = run.read_json(run.retry_record(k))
    except StateFileError:
        return None  # its gae names the damaged file
    if not record or not record.get("id"):
        return None
    if any(e.get("kind") == "retry" and e.get("retry_id") == record["id"] for e in run.events()):
        return None
    return record


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
        try:
            manifest = read_manifest(run, k)
            verdict = read_verdict(run, k) or {}
        except StateFileError:
            break  # a damaged record shows no commit (`rlhf status` names it)
        if manifest.get("guard", {}).get("status") != "done" or verdict.get("decision") != "commit":
            break
        if not state_exists(run, k) and not manifest.get("update", {}).get("checkpoint_pruned"):
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


def fall_back(run: RunDir, good: int, reason: str) -> str:
    """Put the run back as if ``good`` (0: the initial models) were its last commit, because of
    ``reason`` (what cannot be rebuilt, naming its own file and iteration): the gae/update/guard
    records of the commits after it become ``stale`` (they rerun; a rollout or score is reused only
    where its inputs, the state it started from included, come out the same), the commit log is cut
    after it (one atomic write), their checkpoints are discarded, and a ``fallback`` event and a
    warning line say so. Each step is idempotent, so a crash in between is repaired by resuming
    again. Returns the line."""
    committed = committed_iterations(run)
    bad = committed[-1] if committed else good
    on_disk = set(run.iterations())
    for j in (j for j in committed if j > good and j in on_disk):
        try:
            manifest = read_manifest(run, j)
        except StateFileError:
            manifest = {}  # rebuilt by the stages that rerun
        for stage in ROLLED_BACK_STAGES:
            if stage in manifest:
                manifest[stage]["status"] = "stale"
        write_manifest(run, j, manifest)
    _write_log(run, [k for k in committed if k <= good])
    for j in (j for j in committed if j > good):  # their updates rerun and write new ones
        discard_checkpoint(run, j)
    target = f"iteration {good}" if good else "the initial models"
    again = f"iteration {bad} will be rerun" if bad == good + 1 else f"iterations {good + 1}..{bad} will be rerun"
    message = f"{reason}: falling back to {target}; {again}"
    run.append_event("fallback", good, last_good_before=bad, message=message)
    print(f"rlhf: warning: {message}", file=sys.stderr)
    return message


def _warn(run: RunDir, kind: str, message: str) -> None:
    run.append_event(kind, None, message=message)
    print(f"rlhf: warning: {message}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# prune
# ---------------------------------------------------------------------------------------------


def prune_checkpoints(trainer: TrainerConfig, run: RunDir) -> list[int]:
    """Delete committed checkpoints that are neither last-good nor among the last
    trainer.max_ckpt_to_keep save points; note it in the update record. Returns the iterations."""
    committed = committed_iterations(run)
    save_points = [k for k in committed if save_due(trainer, k)]
    keep = set(save_points[-trainer.max_ckpt_to_keep:] if trainer.max_ckpt_to_keep > 0 else [])
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


def edited_retry_records(run: RunDir, through: int) -> list[str]:
    """One line for each committed iteration up to ``through`` whose retry record
    (``iter_k/retry.json``, an input of its gae) is not what its gae read: edited or deleted since.
    Its iteration trained with what the record said; a resume must not rebuild it from another
    (it fell back and retrained with the edited scale). Reads and hashes; writes nothing."""
    if through < 1:
        return []
    try:
        committed = committed_iterations(run)
    except StateFileError:
        return []  # a damaged commit log: the resume rebuilds it first, status names it
    lines = []
    for k in (k for k in committed if k <= through):
        try:
            record = read_manifest(run, k).get("gae") or {}
        except StateFileError:
            continue  # a damaged record is status's and the resume's to name
        inputs = record.get("inputs") or {}
        retry = run.retry_record(k)
        key = record_key(run, retry)
        now = path_digest(run, retry)
        if key not in inputs or now == inputs[key]:  # not an input without the KL in the reward
            continue
        how = "deleted" if now is None else "edited"
        lines.append(f"{key} was {how} after iteration {k}'s gae read it (iteration {k} trained with what it said, "
                     "and a retry's record is never edited)")
    return lines


def refuse_edited_retry_records(run: RunDir, through: int) -> None:
    """``edited_retry_records`` as one ``DataError``: put the file back, or start a new run."""
    lines = edited_retry_records(run, through)
    if lines:
        raise DataError(f"cannot resume {run.root}: {lines[0]}; put the file back as the retry wrote it (or start a "
                        "new run)")
