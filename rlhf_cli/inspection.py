"""The commands that only read: the resolved config, a run's status, SQL over a run. They load
neither Prefect, MLflow nor the model libraries' loaders.

    rlhf config show | status RUN | query RUN "SQL"
"""

from __future__ import annotations

import argparse
from pathlib import Path

import duckdb
import pyarrow.csv as pacsv

from rlhf_core.config import flatten, to_yaml
from rlhf_core.config.inputs import check_inputs
from rlhf_core.errors import RLHFError, disk_full_as_user_error
from rlhf_core.run.layout import RunDir
from rlhf_core.run.plan import note_loggers, resolve_run_config
from rlhf_core.run.query import csv_ready, format_status, format_table, query


def require_run_dir(path: Path) -> None:

    if not RunDir(path).config_path.is_file():
        raise RLHFError(f"{path} is not a run directory (no config.yaml); runs live under trainer.runs_root")


def cmd_config_show(args: argparse.Namespace) -> int:
    """The resolved config, after the same checks `rlhf run` makes before any work (keys, values,
    paths), so an error shows here first."""

    cfg = resolve_run_config(None, args.preset, args.overrides)
    check_inputs(cfg)
    note_loggers(cfg)
    if args.flat:
        for key, value in flatten(cfg).items():
            print(f"{key}={value}")
    else:
        print(to_yaml(cfg), end="")
    return 0


def cmd_status(args: argparse.Namespace) -> int:

    require_run_dir(args.run_dir)
    print(format_status(args.run_dir))
    return 0


def cmd_query(args: argparse.Namespace) -> int:

    require_run_dir(args.run_dir)
    try:
        table = query(args.run_dir, args.sql)
    except duckdb.Error as exc:
        raise RLHFError(f"query failed: {exc}\n(views: prompts, rejects, generation_batches, rollouts, scored, "
                        "advantages, response_kl, validation, metrics, metrics_wide, stages, events)") from None
    print(format_table(table, max_rows=args.max_rows))
    if args.csv:
        with disk_full_as_user_error(args.csv):
            pacsv.write_csv(csv_ready(table), args.csv)  # nested columns as JSON text
        print(f"wrote {args.csv}")
    return 0
