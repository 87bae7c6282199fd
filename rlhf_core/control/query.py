"""DuckDB over a whole run directory, and the per-iteration status table.

``connect(run)`` opens an in-memory DuckDB with one view per table of the run, spanning every
iteration (each row carries its ``iteration``):

    prompts             prompts/train.parquet + val.parquet, with a ``split`` column
    rejects             prompts/rejects.parquet (source_file, source_row, reason, raw)
    generation_batches  pack/generation_batches.parquet
    rollouts            iter_*/rollout.parquet
    scored              iter_*/scored.parquet (rollout columns + reward, old/ref log-probs, values)
    advantages          iter_*/advantages.parquet (scored columns + token rewards, advantages, returns)
    response_kl         one row per scored response: iteration, prompt_id, sample_index, reward,
                        response_length, kl = token-mean of old_log_probs − ref_log_probs
    validation          iter_*/validation.parquet: the sampled validation responses, reward, correct
    metrics             iter_*/iteration_metrics.json (every stage's metrics), long: iteration, name, value
    metrics_wide        the same, one row per iteration, one column per metric ("reward/mean", …)
    stages              every manifest record: iteration (NULL = setup), stage, status, seconds, …
                        (started_at / finished_at / skipped_at: timestamps, UTC)
    events              events.jsonl: time (a timestamp, UTC), kind, iteration, details (JSON of the other fields)

    rlhf query runs/demo "SELECT iteration, avg(reward) FROM scored GROUP BY 1 ORDER BY 1"
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa

from rlhf_core.data import schemas
from rlhf_core.run.layout import RunDir, StateFileError
from rlhf_core.run.integrity import damaged_checkpoints, find_damage
from rlhf_core.config import ConfigError, config_from_dict
from rlhf_core.errors import CheckpointError, DataError
from rlhf_core.run.lifecycle import (commit_log_problem, committed_iterations, last_good_iteration, newest_durable,
                                    read_last_good, read_retry_scale, retries_recorded)
from rlhf_core.run.migrate import outdated
from rlhf_core.run.manifest import read_manifest
from rlhf_core.run.saved_config import run_config_tree
from rlhf_core.stages.base import out_of_date, stage_label
from rlhf_core.stages.gae import edited_retry_records
from rlhf_core.stages.preprocess import refuse_changed_data
from rlhf_core.run.stage_order import ITERATION_STAGES, SETUP_STAGES
from rlhf_core.training.lineage import environment_changes, read_state_record

PARQUET_VIEWS = {
    "rollouts": (RunDir.rollout, schemas.ROLLOUT),
    "scored": (RunDir.scored, schemas.SCORED),
    "advantages": (RunDir.advantages, schemas.ADVANTAGES),
}

VIEW_NAMES = ("prompts", "rejects", "generation_batches", *PARQUET_VIEWS, "validation", "response_kl", "metrics",
              "metrics_wide", "stages", "events")


def _files_view(con, name: str, files: list[Path], schema: pa.Schema, extra_select: str = "") -> None:
    """A view over ``files`` (schemas unioned by name), or an empty table of ``schema`` when none."""
    if not files:
        con.register(f"_{name}_empty", schema.empty_table())
        con.execute(f"CREATE VIEW {name} AS SELECT *{extra_select} FROM _{name}_empty")
        return
    listed = ", ".join("'" + str(f).replace("'", "''") + "'" for f in files)
    con.execute(f"CREATE VIEW {name} AS SELECT *{extra_select} FROM read_parquet([{listed}], union_by_name=true)")


def _prompts_view(con, run: RunDir) -> None:
    parts = [(p, split) for p, split in ((run.train_prompts, "train"), (run.val_prompts, "val")) if p.is_file()]
    if not parts:
        con.register("_prompts_empty", schemas.PROMPTS.append(pa.field("split", pa.string())).empty_table())
        con.execute("CREATE VIEW prompts AS SELECT * FROM _prompts_empty")
        return
    union = " UNION ALL BY NAME ".join(
        f"SELECT *, '{split}' AS split FROM read_parquet('{p}')" for p, split in parts)
    con.execute(f"CREATE VIEW prompts AS {union}")


def read_iteration_metrics(run: RunDir, k: int) -> dict[str, Any]:
    """The merged metrics of iteration ``k``; before it closed, whatever the update stage wrote.
    Iteration 0 is the initial policy's validation (the baseline later accuracies are read against)."""
    merged = run.read_json(run.iteration_metrics(k))
    if merged is not None:
        return merged
    if k == 0:
        return dict(read_manifest(run, 0).get("validate", {}).get("metrics") or {})
    return run.read_json(run.metrics(k)) or {}


def metrics_table(run: RunDir) -> pa.Table:
    rows = []
    for k in run.iterations():
        for name, value in read_iteration_metrics(run, k).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                rows.append({"iteration": k, "name": name, "value": float(value)})
    return pa.Table.from_pylist(rows, schema=pa.schema([("iteration", pa.int32()), ("name", pa.string()),
                                                         ("value", pa.float64())]))


def metrics_wide_table(run: RunDir) -> pa.Table:
    by_iter: dict[int, dict[str, float]] = {}
    names: list[str] = []
    for row in metrics_table(run).to_pylist():
        by_iter.setdefault(row["iteration"], {})[row["name"]] = row["value"]
        if row["name"] not in names:
            names.append(row["name"])
    columns = {"iteration": pa.array(sorted(by_iter), pa.int32())}
    for name in sorted(names):
        if name == "iteration":  # the key column already; the metric of that name would overwrite it
            continue
        columns[name] = pa.array([by_iter[k].get(name) for k in sorted(by_iter)], pa.float64())
    return pa.table(columns) if by_iter else pa.table({"iteration": pa.array([], pa.int32())})


TIMESTAMP = pa.timestamp("ms", tz="UTC")
"""The run's epoch seconds (manifests, events) as the views show them: SQL compares them with
`now() - INTERVAL 1 HOUR`, and `rlhf query` prints them as dates, not 1.79628e+09."""


def _when(seconds: Any) -> Optional[datetime]:
    return datetime.fromtimestamp(seconds, tz=timezone.utc) if isinstance(seconds, (int, float)) else None


def stages_table(run: RunDir) -> pa.Table:
    rows = []
    committed = set(_committed_or_none(run))
    for k in [None, *run.iterations()]:
        try:
            manifest = read_manifest(run, k)
        except StateFileError:  # `rlhf status` names it; the query sees the other records
            continue
        for stage, rec in manifest.items():
            rows.append({"iteration": k, "stage": stage, "status": rec.get("status"),
                         "seconds": rec.get("seconds"), "config_hash": rec.get("config_hash"),
                         "started_at": _when(rec.get("started_at")), "finished_at": _when(rec.get("finished_at")),
                         "skipped_at": _when(rec.get("skipped_at")),
                         "committed": (k in committed) if stage == "guard" else None,
                         "metrics": json.dumps(rec.get("metrics", {}), sort_keys=True)})
    schema = pa.schema([("iteration", pa.int32()), ("stage", pa.string()), ("status", pa.string()),
                        ("seconds", pa.float64()), ("config_hash", pa.string()), ("started_at", TIMESTAMP),
                        ("finished_at", TIMESTAMP), ("skipped_at", TIMESTAMP), ("committed", pa.bool_()),
                        ("metrics", pa.string())])
    return pa.Table.from_pylist(rows, schema=schema)


def events_table(run: RunDir) -> pa.Table:
    rows = [{"time": _when(e.get("time")), "kind": e.get("kind"), "iteration": e.get("iteration"),
             "details": json.dumps({k: v for k, v in e.items() if k not in ("time", "kind", "iteration")},
                                   sort_keys=True, default=str)} for e in run.events()]
    schema = pa.schema([("time", TIMESTAMP), ("kind", pa.string()), ("iteration", pa.int32()),
                        ("details", pa.string())])
    return pa.Table.from_pylist(rows, schema=schema)


def connect(run: RunDir | str | Path):
    """In-memory DuckDB connection with every view of the module docstring registered."""
    import duckdb

    run = run if isinstance(run, RunDir) else RunDir(run)
    con = duckdb.connect()
    _prompts_view(con, run)
    _files_view(con, "rejects", [run.rejects] if run.rejects.is_file() else [], schemas.REJECTS)
    _files_view(con, "generation_batches", [run.generation_batches] if run.generation_batches.is_file() else [],
                schemas.GENERATION_BATCHES)
    for view, (path_of, schema) in PARQUET_VIEWS.items():
        files = [path_of(run, k) for k in run.iterations() if path_of(run, k).is_file()]
        _files_view(con, view, files, schema)
    _files_view(con, "validation", [run.validation(k) for k in run.iterations()
                                    if run.validation(k).is_file()], schemas.VALIDATION)
    con.execute("""CREATE VIEW response_kl AS
        SELECT iteration, prompt_id, sample_index, reward, response_length,
               CASE WHEN len(old_log_probs) = 0 THEN NULL
                    ELSE list_sum(old_log_probs) / len(old_log_probs)
                       - list_sum(ref_log_probs) / len(ref_log_probs) END AS kl
        FROM scored""")
    for name, table in (("metrics", metrics_table(run)), ("metrics_wide", metrics_wide_table(run)),
                        ("stages", stages_table(run)), ("events", events_table(run))):
        con.register(f"_{name}", table)
        con.execute(f"CREATE VIEW {name} AS SELECT * FROM _{name}")
    return con


def query(run: RunDir | str | Path, sql: str) -> pa.Table:
    """Run ``sql`` against the run's views; returns an Arrow table."""
    con = connect(run)
    try:
        return con.sql(sql).to_arrow_table()
    finally:
        con.close()


_ESCAPED = str.maketrans({"\n": "\\n", "\r": "\\r", "\t": "\\t"})
"""Line breaks and tabs in a cell, written as Python writes them in a string (``\\n``)."""


def format_table(table: pa.Table, max_rows: int = 50, max_width: int = 40, missing: str = "NULL") -> str:
    """Plain fixed-width rendering for the terminal; a missing value reads ``missing`` (SQL's NULL
    for a query, "-" in the status table)."""
    names = table.column_names
    rows = table.slice(0, max_rows).to_pylist()

    def cell(v: Any) -> str:
        if isinstance(v, float):
            text = f"{v:.6g}"
        elif isinstance(v, datetime):  # to the second: the run's clock, not 1.79628e+09
            text = v.isoformat(sep=" ", timespec="seconds")
        else:
            text = missing if v is None else str(v)
        text = text.translate(_ESCAPED)  # a response's newline would start a new row of the table
        return text if len(text) <= max_width else text[: max_width - 1] + "…"

    cells = [[cell(r[n]) for n in names] for r in rows]
    widths = [max([len(n)] + [len(c[i]) for c in cells]) for i, n in enumerate(names)]
    lines = ["  ".join(n.ljust(w) for n, w in zip(names, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    if table.num_rows > max_rows:
        lines.append(f"... {table.num_rows - max_rows} more rows")
    lines.append(f"({table.num_rows} row{'s' if table.num_rows != 1 else ''})")
    return "\n".join(lines)


def csv_ready(table: pa.Table) -> pa.Table:
    """``table`` in a form pyarrow's CSV writer takes: every nested column (struct, list, map) as
    JSON text, one JSON value per cell (a map as an object with text keys), and a column it cannot
    write as text (an interval) as each value's text; a null stays null (an empty cell). Columns it
    writes already are left as they are."""
    columns = []
    for field, column in zip(table.schema, table.columns):
        if pa.types.is_nested(field.type):
            column = pa.array([_json_cell(v, pa.types.is_map(field.type)) for v in column.to_pylist()],
                              type=pa.string())
        elif not _writes_as_text(column):
            column = pa.array([None if v is None else str(v) for v in column.to_pylist()], type=pa.string())
        columns.append(column)
    return pa.table(columns, names=table.column_names)


def _json_cell(value: Any, is_map: bool) -> Optional[str]:
    if value is None:
        return None
    if is_map:  # pyarrow gives a map as (key, value) pairs
        value = {str(k): v for k, v in value}
    return json.dumps(value, default=str, ensure_ascii=False)


def _writes_as_text(column: pa.ChunkedArray) -> bool:
    """Whether the CSV writer can turn this column's type into text (it casts each column to
    string; an unsupported cast fails on an empty slice as it would on the data)."""
    try:
        column.slice(0, 0).cast(pa.string())
        return True
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid):
        return False


# ---------------------------------------------------------------------------------------------
# status
# ---------------------------------------------------------------------------------------------


def stage_state(record: Optional[dict]) -> str:
    """done | skipped | stale | rolled_back | failed | - (never ran). ``skipped`` = the last
    invocation found the stage up to date and reused its outputs."""
    if not record:
        return "-"
    status = record.get("status", "?")
    if status == "done" and (record.get("skipped_at") or 0) > (record.get("finished_at") or 0):
        return "skipped"
    return status


def _committed_or_none(run: RunDir) -> list[int]:
    """The commit log's iterations; [] while it is damaged (``status_problems`` says so)."""
    try:
        return committed_iterations(run)
    except StateFileError:
        return []


def status_table(run: RunDir | str | Path) -> list[dict[str, Any]]:
    """One dict per iteration: each stage's state, key metrics (reward, KL, validation accuracy and
    score; None where not measured), rollbacks, checkpoint presence."""
    run = run if isinstance(run, RunDir) else RunDir(run)
    committed = _committed_or_none(run)
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
        refuse_changed_data(config_from_dict(run_config_tree(run)[0]).data, run, last_good)
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
    committed = _committed_or_none(run)
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
    committed = _committed_or_none(run)
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
    committed = _committed_or_none(run)
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
