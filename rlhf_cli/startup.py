"""The line a console `rlhf run` / `rlhf demo` shows while it starts, so a first run is never silent.

Before the flow prints its first line the command loads torch, Prefect, MLflow and DeepSpeed and
waits for its Prefect server: 10-30 s on a 2-core machine (more while other jobs run). On a terminal
a tqdm bar of unknown length on stderr says what it waits for and for how long, redrawn every half
second by a thread, and is cleared before the run prints anything else (``end``), an error or Ctrl-C
included. Where stderr is a pipe or a file (CI, `| tee`), where tqdm would write a line per redraw,
each step is one plain line instead.

    starting: loading torch, Prefect, MLflow, DeepSpeed 00:12
"""

from __future__ import annotations

import sys
import threading
from typing import Optional

from tqdm import tqdm

_bar: Optional[tqdm] = None
_stop = threading.Event()


def begin(what: str) -> None:
    """Show ``starting: <what> <elapsed>`` until ``end``."""
    global _bar
    if _bar is not None:
        return
    if not sys.stderr.isatty():
        _say(what)
        return
    _stop.clear()
    _bar = tqdm(total=None, desc=f"starting: {what}", bar_format="{desc} {elapsed}", file=sys.stderr, leave=False,
                disable=False, dynamic_ncols=True)
    threading.Thread(target=_redraw, args=(_bar,), name="rlhf-startup-bar", daemon=True).start()


def step(what: str) -> None:
    """Say what the start waits for now."""
    if _bar is not None:
        _bar.set_description_str(f"starting: {what}")
    elif not sys.stderr.isatty():
        _say(what)


def end() -> None:
    """Clear the line (nothing when none is shown)."""
    global _bar
    bar, _bar = _bar, None
    if bar is not None:
        _stop.set()
        bar.close()


def _say(what: str) -> None:
    print(f"starting: {what}", file=sys.stderr, flush=True)


def _redraw(bar: tqdm) -> None:
    while not _stop.wait(0.5):
        try:
            bar.refresh()
        except Exception:  # closed under it: the start is over
            return
