"""Progress-bar policy shared by the stages."""

from __future__ import annotations

import os
from typing import Optional


def bar_disabled(progress: Optional[bool] = None) -> bool:
    """Whether a stage's own progress bar is hidden: as the caller asks, else off when the console is
    quiet (TQDM_DISABLE set, as `rlhf run` does so the iteration table stays readable)."""
    if progress is not None:
        return not progress
    return os.environ.get("TQDM_DISABLE", "").lower() not in ("", "0", "false")
