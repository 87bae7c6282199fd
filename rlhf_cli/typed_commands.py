"""How the commands a run prints are typed: its closing block's rlhf and MLflow commands must work as
printed in the shell that ran the run. After `make demo` the project's environment is not activated, so its
console scripts are not on the PATH: the printed command then names them by path (`.venv/bin/rlhf`)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def as_typed(name: str) -> str:
    """``name`` when the PATH finds this environment's console script of that name; else the script's
    path, relative to the current directory where it lies below it."""
    mine = Path(sys.executable).parent / name  # the environment's bin/, not the interpreter it links to
    if not mine.is_file():
        return name
    found = shutil.which(name)
    if found and Path(found).resolve() == mine.resolve():
        return name
    try:
        return str(mine.absolute().relative_to(Path.cwd()))
    except ValueError:
        return str(mine.absolute())
