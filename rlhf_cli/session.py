"""What one `rlhf` invocation knows across its modules: the run directory `rlhf run` planned (for
the resume hint after Ctrl-C), whether that hint was printed already, the Prefect server the command
reports to, and why it stopped when Ctrl-C was not the reason."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:  # for the annotations only: `rlhf --help` should not load pyarrow
    from rlhf_cli.prefect_server import Reporting, ServerWatch
    from rlhf_core.run.layout import RunDir

RUN_DIR: Optional[RunDir] = None
SAID_INTERRUPTED = False
STDERR_FD: Optional[int] = None
"""A duplicate of the stderr this invocation started with, for the line printed after Ctrl-C."""
REPORTING: Optional[Reporting] = None
"""The Prefect server this command reports to (None: it runs no flow, or Prefect chose)."""
WATCH: Optional[ServerWatch] = None
"""What notices that server going away; the console script keeps it to the end of the process
(Prefect delivers its last events at exit), an in-process caller's command closes it."""
STOP: Optional[tuple[str, int]] = None
"""(the line to print, the exit status) when the command is stopped for another reason than Ctrl-C:
SIGTERM, or its Prefect server went away (then it is stopped the same way: SIGINT to its main thread)."""
ON_SIGNAL: Optional[Callable] = None
"""The console script's SIGINT and SIGTERM handler (``rlhf_cli.main``), which the flows put back over
Prefect's SIGTERM handler (``tasks.prefect_runs.COMMAND_SIGTERM``); None for an in-process caller."""
WORK_DONE = False
"""The command's flows are over and its output printed: a server that goes away now stops nothing."""
