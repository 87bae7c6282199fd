"""Command-line checks the benchmark scripts share, so that a bad value is refused while the arguments
are parsed — argparse's usage line and one ``error: argument --X: ...`` line, exit status 2 — before a
model is built, a run started or a heavy library imported, instead of a traceback minutes later.

    from arguments import positive_int, fraction, output_file
    parser.add_argument("--batch", type=positive_int, default=256)
    parser.add_argument("--out", type=output_file)

The ``type=`` functions raise ``argparse.ArgumentTypeError``: argparse prefixes the option's name, so a
message here says what is wrong with the value and what to give instead. Checks that compare two
options, or that need a library (``require_device``), run after parsing through ``parser.error``.
Only the standard library is imported here: a refusal must cost no import time.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Callable

__all__ = ["at_least", "existing_dir", "existing_file", "fraction", "device_name", "nonnegative_int", "note",
           "output_dir", "output_file", "override", "positive_float", "positive_int", "require_device", "tiny_hidden_size", "zero_stage"]


def _number(text: str, kind: type, what: str):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def at_least(low: int) -> Callable[[str], int]:
    """A ``type=`` for whole numbers >= ``low`` (counts, sizes, repeats)."""
    def whole_number(text: str) -> int:
        value = _number(text, int, "a whole number")
        if value < low:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {low}, got {value}")
        return value
    return whole_number


positive_int = at_least(1)
"""Counts, sizes, repeats: 0 would measure nothing (or divide by it)."""
nonnegative_int = at_least(0)


def positive_float(text: str) -> float:
    value = _number(text, float, "a number")
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def fraction(text: str) -> float:
    """A share of something in (0, 1], e.g. of the GPU's memory: 0 would leave nothing to work with."""
    value = _number(text, float, "a number")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1], got {text}")
    return value


def zero_stage(text: str) -> int:
    value = _number(text, int, "a whole number")
    if value not in (0, 1, 2, 3):
        raise argparse.ArgumentTypeError(f"must be a DeepSpeed ZeRO stage (0, 1, 2 or 3), got {value}")
    return value


TINY_HEAD_WIDTH_STEP = 8
"""rlhf_core.models.tiny's 4 attention heads, each of an even width (rotary embeddings rotate pairs)."""


def tiny_hidden_size(text: str) -> int:
    """A hidden size for the tiny model's layout: a multiple of 8, or the model cannot be built."""
    value = _number(text, int, "a whole number")
    if value < TINY_HEAD_WIDTH_STEP or value % TINY_HEAD_WIDTH_STEP:
        raise argparse.ArgumentTypeError(f"must be a multiple of {TINY_HEAD_WIDTH_STEP} (the tiny model's 4 "
                                         f"attention heads, each of an even width), got {value}")
    return value


def existing_file(text: str) -> Path:
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    return path


def existing_dir(text: str) -> Path:
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: no such directory")
    return path


def output_file(text: str) -> Path:
    """A file the script writes at the end: its directory must exist now, not after an hour of work."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file name")
    if not path.resolve().parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: its directory {path.parent} does not exist; create it first")
    return path


def output_dir(text: str) -> Path:
    """A directory the script fills (a model cache, an output folder): made if absent, but not a file."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file; give a directory")
    return path


def override(text: str) -> str:
    """A dotted config override, as the config loader reads it (hydra's ``+key=value`` too): without
    ``=`` the loader would refuse it only after the models are built."""
    key, equals, _ = text.partition("=")
    if not equals or not key.strip().lstrip("+"):
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE (a dotted config key, e.g. trainer.seed=1)")
    return text


def device_name(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``: the form only (``require_device`` asks whether it is here)."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"{text!r}: give cpu, cuda or cuda:N")
    return text


def require_device(parser: argparse.ArgumentParser, option: str, device: str, fix: str = "") -> None:
    """Refuse a CUDA device this machine lacks. Imports torch (seconds), so call it after the cheap checks."""
    if not device.startswith("cuda"):
        return
    import torch

    index = int(device.partition(":")[2] or 0)
    if not torch.cuda.is_available():
        parser.error(f"{option} {device}: this machine has no CUDA device; use {option} cpu{fix}")
    if index >= torch.cuda.device_count():
        parser.error(f"{option} {device}: this machine has {torch.cuda.device_count()} CUDA device(s); "
                     f"give an index below that")


def note(script: str, message: str) -> None:
    """One line on stderr for a value derived from the others (what the user did not set, and why)."""
    print(f"{script}: {message}", file=sys.stderr, flush=True)
