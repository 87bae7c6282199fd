"""The commands that only read: the resolved config, a run's status, SQL over a run. They load
neither Prefect, MLflow nor the model libraries' loaders.

    rlhf config show | status RUN | query RUN "SQL"

``plan_run_command`` is `rlhf run` / `rlhf demo`'s own check of the same kind: the config, its
inputs and the run directory, made before the command loads Prefect, MLflow and DeepSpeed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import duckdb
import pyarrow.csv as pacsv

from rlhf_core.config import flatten, to_yaml
from rlhf_core.paths import project_root
from rlhf_core.run.inputs import check_inputs
from rlhf_core.errors import RLHFError, disk_full_as_user_error
from rlhf_core.run.layout import RunDir
from rlhf_core.control.plan import RunPlan, note_loggers, plan_run, resolve_run_config
from rlhf_core.control.query import csv_ready, format_status, format_table, query


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


GRPO_DEMO = ("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4")
"""`rlhf demo --grpo`: the demo preset with GRPO, four responses per prompt normalised within their group."""


def demo_as_run(args: argparse.Namespace) -> argparse.Namespace:
    """`rlhf demo [--grpo] [--iterations N] ...` as the `rlhf run` it stands for."""
    overrides = [*GRPO_DEMO, *args.overrides] if getattr(args, "grpo", False) else list(args.overrides)
    return argparse.Namespace(command="run", preset=str(project_root() / "configs" / "demo.yaml"), overrides=overrides,
                              run_name=args.run_name, resume=None, iterations=getattr(args, "iterations", None),
                              verbose=args.verbose)


def plan_run_command(args: argparse.Namespace) -> RunPlan:
    """`rlhf run`'s plan (``rlhf_core.control.plan.plan_run``): a bad key, value, preset or path, a missing
    or unusable model folder, a run directory that exists, each one line here, before the command
    imports Prefect, MLflow and DeepSpeed (seconds, not the 10-20 s those take). Writes nothing."""
    if args.iterations is not None and args.iterations < 1:
        raise RLHFError(f"--iterations {args.iterations}: must be at least 1; give --iterations N with N >= 1")
    return plan_run(preset=None if args.resume else args.preset, overrides=list(args.overrides),
                    iterations=args.iterations, run_name=args.run_name, resume=args.resume)


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
