"""Progress-bar policy shared by the stages."""

from __future__ import annotations

import os
from typing import Optional


def bar_disabled(progress: Optional[bool] = None) -> bool:
    """Whether a stage's own progress bar is hidden: as the caller asks, else off when the console is
    quiet (``quiet_console``)."""
    if progress is not None:
        return not progress
    return quiet_console()


def quiet_console() -> bool:
    """Whether the console is kept to the iteration table, warnings and errors (TQDM_DISABLE set, as
    `rlhf run` does without --verbose so the table stays readable)."""
    return os.environ.get("TQDM_DISABLE", "").lower() not in ("", "0", "false")
