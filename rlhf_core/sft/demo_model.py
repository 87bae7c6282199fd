"""The demo's shipped starting point: the warm-started tiny model in ``data/models/demo``, and its recipe.

    rlhf model build-demo [--out data/models/demo]

The warm start (``sft.warm_start``) is 1,000 optimizer steps of float arithmetic; two machines with
other vector units (AVX2 / AVX-512), another torch or another MKL sum in another order, and after
1,000 steps the weights differ in their last bits, enough for PPO's sampled curve to come out
otherwise. So the demo does not warm-start at run time: ``configs/demo.yaml`` starts from this
directory, which the recipe below made once on the reference machine and the repository ships
(about 2 MB). The recipe is the run-time warm start itself, on the demo preset's data and settings:

    1. the tiny model (``models.tiny.build_tiny_model``, default spec) in a temporary directory;
    2. ``sft.warm_start.warm_start`` of it with configs/demo.yaml's data section and the default
       warm-start settings (``actor_rollout_ref.model.warm_start``);
    3. its files copied here, ``warm_start.json`` without the build's seconds, and ``build.json``:
       the command, the machine it ran on (``machine_fingerprint``) and the sha256 of every file.

``tests/rlhf_core/sft/test_demo_model.py`` checks the shipped files against build.json everywhere,
and on a machine with the reference fingerprint builds them again and compares every byte.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional

from rlhf_core.config.loader import load_config
from rlhf_core.io.atomic import atomic_dir
from rlhf_core.io.hashing import sha256_file
from rlhf_core.models.tiny import build_tiny_model
from rlhf_core.paths import project_root
from rlhf_core.sft.warm_start import warm_start

DEMO_MODEL = Path("data") / "models" / "demo"
"""Where the shipped model lives, relative to the checkout (configs/demo.yaml names it so)."""
DEMO_PRESET = Path("configs") / "demo.yaml"
BUILD_RECORD = "build.json"
RECIPE = "rlhf model build-demo --out data/models/demo"

FINGERPRINT_KEYS = ("cpu", "cpu_capability", "python", "torch", "transformers", "tokenizers", "safetensors")
"""What must equal the reference machine's for a rebuild to reproduce the shipped bytes: the CPU
(its model and the vector code path torch dispatches to), and the libraries whose arithmetic,
tokenizer training or file format the recipe goes through."""


def cpu_model() -> str:
    """The processor's model name (/proc/cpuinfo on Linux), else what ``platform`` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_fingerprint() -> dict[str, str]:
    """The ``FINGERPRINT_KEYS`` of this machine."""
    import safetensors
    import tokenizers
    import torch
    import transformers

    return {"cpu": f"{cpu_model()} ({platform.machine()})", "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "python": platform.python_version().rpartition(".")[0], "torch": torch.__version__,
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
            "safetensors": safetensors.__version__}


def fingerprint_difference(reference: dict, here: dict) -> list[str]:
    """'key: here X, reference Y' for every ``FINGERPRINT_KEYS`` entry that differs."""
    return [f"{k}: here {here.get(k)}, reference {reference.get(k)}" for k in FINGERPRINT_KEYS
            if here.get(k) != reference.get(k)]


def build_demo_model(out: str | Path, preset: Optional[str | Path] = None, progress: bool = True) -> Path:
    """Make ``out`` (complete or absent: written atomically) by the recipe above; returns it."""
    started = time.perf_counter()
    preset = Path(preset) if preset else project_root() / DEMO_PRESET
    with tempfile.TemporaryDirectory(prefix="rlhf-demo-model-") as scratch:
        tiny = build_tiny_model(Path(scratch) / "tiny")
        cfg = load_config(preset, [f"actor_rollout_ref.model.path={tiny}",
                                   "actor_rollout_ref.model.warm_start.enable=true"])
        trained = warm_start(cfg.actor_rollout_ref.model, cfg.data, out_root=Path(scratch) / "sft", progress=progress)
        with atomic_dir(out) as tmp:
            for f in sorted(p for p in trained.iterdir() if p.is_file()):
                shutil.copy2(f, tmp / f.name)
            record = json.loads((tmp / "warm_start.json").read_text())
            for varying in ("seconds",):  # the build's own time: kept in build.json, out of the model's files
                record.pop(varying, None)
            (tmp / "warm_start.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
            write_build_record(tmp, preset, time.perf_counter() - started)
    return Path(out)


def write_build_record(directory: Path, preset: Path, seconds: float) -> None:
    """``build.json``: how ``directory`` was made, on what, and the sha256 of each of its files."""
    files = {p.name: sha256_file(p) for p in sorted(directory.iterdir()) if p.is_file() and p.name != BUILD_RECORD}
    record = {"recipe": RECIPE, "preset": _relative(preset), "reference_machine": machine_fingerprint(),
              "threads": 1, "seconds": round(seconds, 1), "files": files}
    (directory / BUILD_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def read_build_record(directory: str | Path) -> dict:
    return json.loads((Path(directory) / BUILD_RECORD).read_text())


def changed_files(directory: str | Path) -> list[str]:
    """The files of a built demo model that do not match its build.json (missing, changed or extra)."""
    directory = Path(directory)
    expected = read_build_record(directory)["files"]
    present = {p.name for p in directory.iterdir() if p.is_file() and p.name != BUILD_RECORD}
    wrong = [name for name, digest in expected.items()
             if name not in present or sha256_file(directory / name) != digest]
    return sorted(wrong + [name for name in present - set(expected)])


def _relative(path: Path) -> str:
    try:
        return str(Path(os.path.relpath(path.resolve(), project_root())))
    except ValueError:
        return str(path)
