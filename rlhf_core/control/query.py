"""DuckDB over a whole run directory (`rlhf query`; `rlhf status` is ``control.status``).

Reads the run's tables and records only: it loads neither the config's schema nor torch, so a query
answers in well under a second.

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
from rlhf_core.run.lifecycle import committed_iterations
from rlhf_core.run.manifest import read_manifest

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


def committed_or_none(run: RunDir) -> list[int]:
    """The commit log's iterations; [] while it is damaged (`rlhf status` says so)."""
    try:
        return committed_iterations(run)
    except StateFileError:
        return []


def stages_table(run: RunDir) -> pa.Table:
    rows = []
    committed = set(committed_or_none(run))
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
