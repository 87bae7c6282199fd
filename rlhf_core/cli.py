"""The `rlhf` command line.

    rlhf config show [-c PRESET] [key=value ...]        print the resolved config
    rlhf stage NAME --run-dir RUN [--iteration K] [-c PRESET] [key=value ...]
    rlhf run [-c PRESET] [key=value ...] [--run-name NAME] [--resume RUN_DIR]
    rlhf demo                                           the main job on the embedded defaults
    rlhf model build-tiny --out DIR                     build the local tiny model + tokenizer
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

# quiet, offline defaults for every entry point (a user's explicit setting wins)
for _key, _value in {
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
    "DO_NOT_TRACK": "1", "MLFLOW_DISABLE_TELEMETRY": "true", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
}.items():
    os.environ.setdefault(_key, _value)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", dest="preset", help="YAML preset (e.g. configs/demo.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted overrides, e.g. algorithm.kl_ctrl.kl_coef=0.002")


def build_parser() -> argparse.ArgumentParser:
    from rlhf_core.stages import STAGES

    parser = argparse.ArgumentParser(prog="rlhf", description="Offline PPO RLHF as a staged, rerunnable DAG.")
    sub = parser.add_subparsers(dest="command", required=True)

    cfg = sub.add_parser("config", help="inspect configuration").add_subparsers(dest="config_cmd", required=True)
    show = cfg.add_parser("show", help="print the resolved config (defaults ← preset ← overrides)")
    _add_config_args(show)
    show.add_argument("--flat", action="store_true", help="one dotted key per line")

    stage = sub.add_parser("stage", help="run (or rerun) one stage on a run directory")
    stage_sub = stage.add_subparsers(dest="stage", required=True)
    for spec in STAGES.values():
        sp = stage_sub.add_parser(spec.name, help=spec.help, description=spec.help)
        sp.add_argument("--run-dir", required=True, type=Path, help="run directory (created if absent)")
        if spec.per_iteration:
            sp.add_argument("--iteration", "-k", type=int, required=True, help="iteration number (1-based)")
        sp.add_argument("--force", action="store_true", help="rerun even if inputs and config are unchanged")
        if spec.name == "update":
            sp.add_argument("--nproc", type=int, default=None, help="data-parallel processes (trainer.nproc)")
        _add_config_args(sp)

    run = sub.add_parser("run", help="run the pipeline")
    _add_config_args(run)
    run.add_argument("--run-name", help="run directory name under trainer.runs_root (default: timestamp)")
    run.add_argument("--resume", type=Path, help="resume an existing run directory")

    demo = sub.add_parser("demo", help="the main job on the embedded default data and tiny model")
    demo.add_argument("overrides", nargs="*", metavar="key=value")

    model = sub.add_parser("model", help="model utilities").add_subparsers(dest="model_cmd", required=True)
    tiny = model.add_parser("build-tiny", help="build the tiny Qwen2-style model + BPE tokenizer locally")
    tiny.add_argument("--out", type=Path, required=True)
    tiny.add_argument("--hidden-size", type=int, default=64)
    tiny.add_argument("--layers", type=int, default=2)
    tiny.add_argument("--vocab-size", type=int, default=512)
    tiny.add_argument("--seed", type=int, default=0)
    return parser


# ---------------------------------------------------------------------------------------------
# commands
# ---------------------------------------------------------------------------------------------


def resolve_run_config(run_dir: Optional[Path], preset: Optional[str], overrides: Sequence[str]):
    """A run's config: its saved config.yaml (+ overrides) when no preset is given, else the preset
    (+ overrides). The result is saved back so later stage reruns see what ran."""
    from rlhf_core.config import apply_overrides, config_from_dict, load_config
    from rlhf_core.config.loader import read_preset

    saved = run_dir / "config.yaml" if run_dir else None
    if preset is None and saved is not None and saved.is_file():
        return apply_overrides(config_from_dict(read_preset(saved)), overrides)
    return load_config(preset, overrides)


def _print_result(result) -> None:
    status = "skipped (up to date)" if result.skipped else f"done in {result.seconds:.1f}s"
    where = f" iteration {result.iteration}" if result.iteration is not None else ""
    print(f"[{result.stage}{where}] {status}")
    for line in result.summary:
        print(f"  {line}")


def cmd_config_show(args: argparse.Namespace) -> int:
    from rlhf_core.config import flatten, load_config, to_yaml

    cfg = load_config(args.preset, args.overrides)
    if args.flat:
        for key, value in flatten(cfg).items():
            print(f"{key}={value}")
    else:
        print(to_yaml(cfg), end="")
    return 0


def cmd_stage(args: argparse.Namespace) -> int:
    from rlhf_core.config import to_yaml
    from rlhf_core.io.rundir import RunDir, RunLock, write_config
    from rlhf_core.stages import get_stage

    overrides = list(args.overrides)
    if getattr(args, "nproc", None):
        overrides.append(f"trainer.nproc={args.nproc}")
    cfg = resolve_run_config(args.run_dir, args.preset, overrides)
    run = RunDir(args.run_dir)
    spec = get_stage(args.stage)
    with RunLock(run):
        write_config(run, to_yaml(cfg))
        result = spec.load()(cfg, run, getattr(args, "iteration", None), force=args.force)
    _print_result(result)
    return 0


def _new_run_dir(cfg, run_name: Optional[str]) -> Path:
    from rlhf_core.paths import resolve_path

    root = resolve_path(cfg.trainer.runs_root) if Path(cfg.trainer.runs_root).is_absolute() else Path(
        cfg.trainer.runs_root).resolve()
    name = run_name or time.strftime("%Y%m%d-%H%M%S")
    path = root / name
    if path.exists() and any(path.iterdir()):
        raise SystemExit(f"run directory {path} already exists; pick another --run-name or use --resume {path}")
    return path


def cmd_run(args: argparse.Namespace) -> int:
    from rlhf_core.pipeline import run_pipeline

    if args.resume:
        cfg = resolve_run_config(args.resume, args.preset, args.overrides)
        run_dir = args.resume
    else:
        cfg = resolve_run_config(None, args.preset, args.overrides)
        run_dir = _new_run_dir(cfg, args.run_name)
    run_pipeline(cfg, run_dir, resume=bool(args.resume))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from rlhf_core.paths import project_root

    ns = argparse.Namespace(preset=str(project_root() / "configs" / "demo.yaml"), overrides=args.overrides,
                            run_name=None, resume=None)
    return cmd_run(ns)


def cmd_build_tiny(args: argparse.Namespace) -> int:
    from rlhf_core.models.tiny import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(hidden_size=args.hidden_size, num_hidden_layers=args.layers,
                         vocab_size=args.vocab_size, seed=args.seed)
    path = build_tiny_model(args.out, spec)
    print(f"tiny model + tokenizer written to {path}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    from rlhf_core.errors import RLHFError

    args = build_parser().parse_args(argv)
    handlers = {
        "config": cmd_config_show, "stage": cmd_stage, "run": cmd_run, "demo": cmd_demo,
        "model": cmd_build_tiny,
    }
    try:
        return handlers[args.command](args) or 0
    except (RLHFError, FileNotFoundError) as exc:
        # user errors: one clear line, no traceback
        print(f"rlhf: error: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
