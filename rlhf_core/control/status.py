"""`rlhf status`: the per-iteration table of a run and every problem a resume or an export would
refuse on (damaged or foreign checkpoints, stale stages, changed data, edited records, a newer
format), each with its fix. Reads only; the SQL views are ``control.query``'s."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import pyarrow as pa

from rlhf_core.run.layout import RunDir, StateFileError
from rlhf_core.run.integrity import damaged_checkpoints, find_damage
from rlhf_core.config import ConfigError
from rlhf_core.config.loader import data_config_from_dict
from rlhf_core.errors import CheckpointError, DataError
from rlhf_core.run.lifecycle import (commit_log_problem, committed_iterations, last_good_iteration, newest_durable,
                                    edited_retry_records, read_last_good, read_retry_scale, retries_recorded)
from rlhf_core.run.migrate import outdated
from rlhf_core.run.manifest import read_manifest
from rlhf_core.run.saved_config import run_config_tree
from rlhf_core.stages.base import out_of_date, stage_label
from rlhf_core.stages.preprocess import refuse_changed_data
from rlhf_core.run.stage_order import ITERATION_STAGES, SETUP_STAGES
from rlhf_core.training.lineage import environment_changes, read_state_record
from rlhf_core.control.query import committed_or_none, format_table, read_iteration_metrics


def stage_state(record: Optional[dict]) -> str:
    """done | skipped | stale | rolled_back | failed | - (never ran). ``skipped`` = the last
    invocation found the stage up to date and reused its outputs."""
    if not record:
        return "-"
    status = record.get("status", "?")
    if status == "done" and (record.get("skipped_at") or 0) > (record.get("finished_at") or 0):
        return "skipped"
    return status


def status_table(run: RunDir | str | Path) -> list[dict[str, Any]]:
    """One dict per iteration: each stage's state, key metrics (reward, KL, validation accuracy and
    score; None where not measured), rollbacks, checkpoint presence."""
    run = run if isinstance(run, RunDir) else RunDir(run)
    committed = committed_or_none(run)
    damaged = damaged_checkpoints(run)
    rollbacks: dict[int, int] = {}
    for e in run.events():
        if e.get("kind") == "rollback" and e.get("iteration") is not None:
            rollbacks[e["iteration"]] = rollbacks.get(e["iteration"], 0) + 1
    rows = []
    for k in run.iterations():
        try:
            manifest = read_manifest(run, k)
        except StateFileError:  # status_problems names it
            manifest = {}
        metrics = _metrics_or_empty(run, k)
        row: dict[str, Any] = {"iteration": k}
        for stage in ITERATION_STAGES + ("validate",):
            row[stage] = stage_state(manifest.get(stage))
        if k in committed:
            row["guard"] = "committed"
        row["reward"] = metrics.get("reward/mean")
        row["kl"] = metrics.get("kl/mean")
        row["val_acc"] = metrics.get("val/accuracy")
        row["val_score"] = metrics.get("val/reward_mean")  # the mean validation reward (verl's val-core mean@n)
        row["rollbacks"] = rollbacks.get(k, 0)
        row["checkpoint"] = (run.checkpoint(k) / "actor").is_dir()
        row["checkpoint_damaged"] = k in damaged
        row["last_good"] = bool(committed and committed[-1] == k)
        rows.append(row)
    return rows


def _checkpoint_cell(row: dict[str, Any]) -> str:
    if row["checkpoint_damaged"]:
        return "damaged"  # never "last-good": status_problems says what a resume does about it
    return ("last-good" if row["last_good"] else "kept") if row["checkpoint"] else "-"


def format_status(run: RunDir | str | Path) -> str:
    run = run if isinstance(run, RunDir) else RunDir(run)
    try:
        setup = read_manifest(run, None)
    except StateFileError:  # status_problems names it
        setup = {}
    lines = [f"run: {run.root}",
             "setup: " + ", ".join(f"{s} {stage_state(setup.get(s))}" for s in SETUP_STAGES)]
    rows = status_table(run)
    if rows:
        table = pa.Table.from_pylist([
            {**{k: v for k, v in r.items() if k not in ("checkpoint", "checkpoint_damaged", "last_good")},
             "ckpt": _checkpoint_cell(r)}
            for r in rows])
        lines.append(format_table(table, max_rows=10_000, missing="-").rsplit("\n", 1)[0])
    else:
        lines.append("no iterations yet")
    lines += accuracy_lines(run) + time_floor_lines(run)
    problems = status_problems(run)
    if problems:
        lines += [f"problem: {line}" for line in problems]
    else:
        last_good = read_last_good(run)
        lines.append(last_good_line(run, last_good))
        lines += replay_lines(run) + uncommitted_lines(run)
    return "\n".join(lines + rerun_lines(run))


def last_good_line(run: RunDir, last_good: Optional[dict]) -> str:
    """'last-good: iteration K (<its checkpoint>)', saying so when that checkpoint is not on disk
    (between save points its state is only in its record; ``replay_lines`` says what a resume does)."""
    if not last_good:
        return "last-good: none (the next iteration starts from the initial model)"
    k, where = last_good["iteration"], last_good["checkpoint"]
    if (run.checkpoint(k) / "actor").is_dir():
        return f"last-good: iteration {k} ({where})"
    return f"last-good: iteration {k} (its checkpoint {where} is not written: only its record is on disk)"


def accuracy_lines(run: RunDir) -> list[str]:
    """Held-out accuracy with its 95 % interval at the run's landmarks: the model before the warm
    start (when it was validated), the initial policy (iteration 0) and the latest validated policy;
    [] before any validation carried its interval."""
    validated = [(k, m) for k in run.iterations() if "val/accuracy_ci_low" in (m := _metrics_or_empty(run, k))]
    if not validated:
        return []
    (first_k, first), (last_k, last) = validated[0], validated[-1]
    rows = []
    if "val_base/accuracy_ci_low" in first:
        rows.append(("before the warm start", "val_base", first))
    rows.append((f"iteration {first_k}" + (" (after the warm start)" if rows else " (the initial policy)" if first_k == 0
                                           else ""), "val", first))
    if last_k != first_k:
        rows.append((f"iteration {last_k}", "val", last))
    width = max(len(label) for label, _, _ in rows)
    return [f"held-out accuracy ({int(first.get('val/num_prompts', 0))} validation prompts; 95 % interval):"] + [
        f"  {label:<{width}}  {m[f'{p}/accuracy']:.3f} [{m[f'{p}/accuracy_ci_low']:.3f}, {m[f'{p}/accuracy_ci_high']:.3f}]"
        for label, p, m in rows]


def time_floor_lines(run: RunDir) -> list[str]:
    """Where the latest iteration's time went: each stage's seconds next to its floor (its model FLOPs at
    this device's measured matmul rate, or a GPU's peak: ``training.flops``) and how many times the floor
    it took, so the stage far from its floor stands out; verl's MFU of the update's roles beside. [] before
    an iteration reported floors."""
    for k in sorted(run.iterations(), reverse=True):
        metrics = _metrics_or_empty(run, k)
        if any(name.startswith("perf/stage_floor_seconds/") for name in metrics):
            break
    else:
        return []
    rows = []
    for stage in ITERATION_STAGES:
        seconds, floor = metrics.get(f"perf/stage_seconds/{stage}"), metrics.get(f"perf/stage_floor_seconds/{stage}")
        if seconds is None:
            continue
        rows.append({"stage": stage, "seconds": round(float(seconds), 2),
                     "floor_s": None if floor is None else float(f"{floor:.3g}"),
                     "x_floor": None if not floor else float(f"{seconds / floor:.3g}")})
    rate = metrics.get("perf/device_matmul_flops_per_s")
    mfu = ", ".join(f"{role} {metrics[f'perf/mfu/{role}']:.3f}" for role in ("actor", "critic")
                    if f"perf/mfu/{role}" in metrics)
    head = (f"time against floor, iteration {k}" + (f" (device matmul {rate / 1e9:,.1f} GFLOP/s)" if rate else "")
            + (f"; verl's perf/mfu: {mfu}" if mfu else "") + ":")
    return [head, format_table(pa.Table.from_pylist(rows), missing="-").rsplit("\n", 1)[0]]


def config_problems(run: RunDir) -> list[str]:
    """config.yaml that does not match its seal, and what a command does about it (``run.saved_config``)."""
    if not run.config_path.is_file():
        return []
    try:
        damaged = run_config_tree(run)[1]
    except StateFileError as exc:
        return [f"{exc}; no committed iteration recorded a config to continue with"]
    return [damaged] if damaged else []


def retry_record_problems(run: RunDir) -> list[str]:
    """Retry records (``iter_k/retry.json``) a resume could not read: damaged, or with a scale or an
    attempt count that is not one."""
    problems = []
    for k in run.iterations():
        if not run.retry_record(k).is_file():
            continue
        try:
            read_retry_scale(run, k)
            retries_recorded(run, k)
        except StateFileError as exc:
            problems.append(str(exc))
    return problems


def data_problems(run: RunDir, last_good: int) -> list[str]:
    """The data files the committed iterations trained on, changed since (what a resume refuses on:
    ``stages.preprocess.refuse_changed_data``)."""
    if last_good < 1 or not run.config_path.is_file():
        return []
    try:
        refuse_changed_data(data_config_from_dict(run_config_tree(run)[0]), run, last_good)
    except (StateFileError, ConfigError):
        return []  # config_problems names a config that cannot be read
    except DataError as exc:
        return [str(exc)]
    return []


def replay_lines(run: RunDir) -> list[str]:
    """When last-good's state is only in its record (a crash between save points), what a resume
    does about it — what ``stages.repair.rebuild_last_good`` will do: replay the updates since the
    newest checkpoint and write it; where this machine differs from the one that recorded one of
    them (``lineage.environment_changes``), that the replay may not reproduce it, and then the
    resume falls back to the commit before it and reruns from there."""
    committed = committed_or_none(run)
    if not committed or (run.checkpoint(committed[-1]) / "actor").is_dir():
        return []
    k, base = committed[-1], newest_durable(run, committed[-1])
    chain = [i for i in committed if base < i <= k]
    start = f"checkpoint {base}" if base else "the initial models"
    which = f"iteration {chain[0]}'s update" if len(chain) == 1 else f"the updates of iterations {chain[0]}-{chain[-1]}"
    lines = [f"iteration {k}'s state is only in its record (between save points): a resume rebuilds it by replaying "
             f"{which} from {start} and writes its checkpoint"]
    for i in chain:
        try:
            changes = environment_changes(read_state_record(run, i))
        except CheckpointError:
            continue  # find_damage names a damaged record
        if changes:
            earlier = f"iteration {i - 1}" if i - 1 > 0 else "the initial models"
            lines.append(f"iteration {i} was trained elsewhere ({'; '.join(changes)}): its replay may not reproduce "
                         f"it here, and then a resume falls back to {earlier} and reruns {_span(i, k)}")
            break
    return lines


def _span(first: int, last: int) -> str:
    return f"iteration {first}" if first == last else f"iterations {first}-{last}"


def uncommitted_lines(run: RunDir) -> list[str]:
    """The iterations after last-good (an interrupted or halted run leaves one; a running run is in
    one) and what continues the run: a resume, which redoes them from last-good. A stage rerun is
    not the way: it would leave them uncommitted."""
    committed = committed_or_none(run)
    after = [k for k in run.iterations() if k >= 1 and k > (committed[-1] if committed else 0)]
    if not after:
        return []
    which = f"iteration {after[0]}" if len(after) == 1 else f"iterations {after[0]}-{after[-1]}"
    return [f"not committed: {which} (running, or stopped before its commit); `rlhf run --resume {run.root}` "
            "continues from last-good and redoes it"]


def rerun_lines(run: RunDir) -> list[str]:
    """Stage reruns with overrides (one line each), and what a resume and an export refuse until
    `rlhf rebuild` reruns it with config.yaml (nothing while a manifest is damaged: the problem
    lines name it)."""
    try:
        return _rerun_lines(run)
    except StateFileError:
        return []


def _rerun_lines(run: RunDir) -> list[str]:
    lines = [f"{stage_label(k, stage)} {why}" for k, stage, why in out_of_date(run, max(run.iterations(), default=0))
             if why != "stale"]
    committed = committed_or_none(run)
    before = out_of_date(run, committed[-1]) if committed else []  # before a commit, a resume redoes it all
    if before:
        lines.append(f"out of date: {len(before)} stage(s) at or before last-good no longer follow config.yaml; resume "
                     f"and export refuse until `rlhf rebuild {run.root}` reruns them")
    return lines


def _metrics_or_empty(run: RunDir, k: int) -> dict[str, Any]:
    try:
        return read_iteration_metrics(run, k)
    except StateFileError:
        return {}


def status_problems(run: RunDir) -> list[str]:
    """What `rlhf status` must say is wrong with the run (one line each): an old directory format,
    the commit log, every committed artifact that does not verify (``run.integrity``: the same check
    a resume and an export make) with what a resume does about it, iteration manifests that are
    missing or damaged."""
    outdated_format = outdated(run)
    if outdated_format:
        return [outdated_format]
    problems = []
    try:
        read_manifest(run, None)
    except StateFileError as exc:
        problems.append(f"{exc}; `rlhf stage <setup stage> --run-dir {run.root} --force` rebuilds its records")
    log = commit_log_problem(run)
    committed: list[int] = []
    if log:
        problems.append(log)
    else:
        committed, last_good = committed_iterations(run), last_good_iteration(run)
        problems += [f"{d.describe(run)}; {d.remedy(run, last_good)}" for d in find_damage(run)]
    last = committed[-1] if committed else 0
    problems += config_problems(run) + data_problems(run, last)
    problems += [f"{line}; a resume refuses: put the file back as the retry wrote it" for line in edited_retry_records(run, last)]
    problems += retry_record_problems(run)
    for k in (k for k in run.iterations() if k not in committed):  # committed ones: find_damage's
        try:
            manifest = run.read_json(run.manifest_path(k))
        except StateFileError as exc:
            problems.append(f"{exc}; `rlhf stage <stage> --run-dir {run.root} --iteration {k} --force` rebuilds "
                            "that iteration's records")
            continue
        uncommitted = k >= 1 and k > (committed[-1] if committed else 0)  # ``uncommitted_lines`` says what to do
        if manifest is None and not uncommitted and any(run.iter_dir(k).iterdir()):
            problems.append(f"{run.manifest_path(k)} is missing: iteration {k}'s stages have no record (its files "
                            f"are there); rerun them with `rlhf stage <stage> --run-dir {run.root} --iteration {k}`")
    return problems
