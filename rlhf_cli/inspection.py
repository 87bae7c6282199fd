"""The commands that only read a config: the resolved config. They load neither Prefect, MLflow nor
the model libraries' loaders (a run's status: ``run_status``; SQL over its tables: ``querying``).

    rlhf config show

``plan_run_command`` is `rlhf run` / `rlhf demo`'s own check of the same kind: the config, its
inputs and the run directory, made before the command loads Prefect, MLflow and DeepSpeed.
"""

from __future__ import annotations

import argparse

from rlhf_core.config import flatten, to_yaml
from rlhf_core.paths import project_root
from rlhf_core.run.inputs import check_inputs
from rlhf_core.errors import RLHFError
from rlhf_core.control.plan import RunPlan, note_loggers, plan_run, resolve_run_config


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
