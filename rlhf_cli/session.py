"""What one `rlhf` invocation knows across its modules: the run directory `rlhf run` planned (for
the resume hint after Ctrl-C) and whether that hint was printed already."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # for the annotation only: `rlhf --help` should not load pyarrow
    from rlhf_core.run.layout import RunDir

RUN_DIR: Optional[RunDir] = None
SAID_INTERRUPTED = False
STDERR_FD: Optional[int] = None
"""A duplicate of the stderr this invocation started with, for the line printed after Ctrl-C."""
