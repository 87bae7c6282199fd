"""`rlhf query RUN "SQL"`: DuckDB over a run's tables (``rlhf_core.control.query``). It loads no
config schema and no torch, so it answers in well under a second."""

from __future__ import annotations

import argparse

import duckdb
import pyarrow.csv as pacsv

from rlhf_core.control.query import VIEW_NAMES, csv_ready, format_table, query
from rlhf_core.errors import RLHFError, disk_full_as_user_error
from rlhf_core.run.layout import require_run_dir


def cmd_query(args: argparse.Namespace) -> int:

    require_run_dir(args.run_dir)
    try:
        table = query(args.run_dir, args.sql)
    except duckdb.Error as exc:
        raise RLHFError(f"query failed: {exc}\n(views: {', '.join(VIEW_NAMES)})") from None
    print(format_table(table, max_rows=args.max_rows))
    if args.csv:
        with disk_full_as_user_error(args.csv):
            pacsv.write_csv(csv_ready(table), args.csv)  # nested columns as JSON text
        print(f"wrote {args.csv}")
    return 0
