"""A background reporter: publishes an iteration's views (MLflow batch, Prefect artifacts, learning
curve) while the next iteration's rollout runs, instead of before it.

Only views go here: everything a resume or a decision reads (manifests, iteration_metrics.json,
last_good, pruning) is written before a job is submitted. Guarantees:

- jobs run one at a time, in submission order, each in a copy of the submitter's context (so Prefect
  artifacts attach to the same flow run, and ``io.timing`` marks their spans as background);
- the queue is bounded (``max_pending``): a reporter that falls behind blocks the submitter
  instead of piling up work;
- ``close()`` waits for every job; the flow calls it before it returns and before it fails;
- a failing job is logged as a warning and kept in ``errors``; the next jobs still run. The run
  directory stays the source of truth: metrics a failed or lost job did not log reach MLflow from
  ``tasks.iteration.backfill_metrics`` (end of the flow, and on resume after a crash).
"""

from __future__ import annotations

import contextvars
import logging
import queue
import threading
from typing import Any, Callable, Optional

from rlhf_core.io import timing

_STOP = object()


class Reporter:
    def __init__(self, log: Optional[logging.Logger | logging.LoggerAdapter] = None, max_pending: int = 2,
                 name: str = "rlhf-reporter"):
        self.log = log or logging.getLogger("rlhf")
        self.errors: list[str] = []
        self._jobs: queue.Queue = queue.Queue(maxsize=max_pending)
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._closed = False
        self._thread.start()

    def submit(self, label: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Queue ``fn(*args, **kwargs)``, to run in a copy of the caller's current context."""
        if self._closed:
            raise RuntimeError(f"reporter closed: cannot queue {label}")
        self._jobs.put((label, contextvars.copy_context(), fn, args, kwargs))

    def close(self) -> list[str]:
        """Run every queued job, stop the thread; returns the errors (also logged). Idempotent."""
        if not self._closed:
            self._closed = True
            self._jobs.put(_STOP)
            self._thread.join()
        return self.errors

    def _work(self) -> None:
        while True:
            item = self._jobs.get()
            if item is _STOP:
                return
            label, ctx, fn, args, kwargs = item
            try:
                ctx.run(_in_background, fn, args, kwargs)
            except BaseException as exc:  # a view failed: say so, keep reporting the next ones
                message = f"{label} failed: {type(exc).__name__}: {exc}"
                self.errors.append(message)
                self.log.warning("background report %s", message)


def _in_background(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    with timing.background():
        return fn(*args, **kwargs)
