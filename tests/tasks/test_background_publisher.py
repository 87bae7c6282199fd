"""The background reporter: order, copied context, bounded queue, failures surfaced, drained on close."""

from __future__ import annotations

import contextvars
import logging
import threading

import pytest

from rlhf_core.io import timing
from tasks.background_publisher import Reporter

WHO = contextvars.ContextVar("who", default="nobody")


def test_jobs_run_in_order_in_the_submitters_context_and_close_drains_them():
    seen = []
    reporter = Reporter()
    token = WHO.set("flow")
    try:
        for i in range(5):
            reporter.submit(f"job {i}", lambda i=i: seen.append((i, WHO.get(), threading.current_thread().name)))
    finally:
        WHO.reset(token)
    assert reporter.close() == []
    assert [s[0] for s in seen] == [0, 1, 2, 3, 4]
    assert {s[1] for s in seen} == {"flow"} and {s[2] for s in seen} == {"rlhf-reporter"}
    with pytest.raises(RuntimeError, match="closed"):
        reporter.submit("late", print)


def test_a_failing_job_is_logged_and_kept_and_later_jobs_still_run(caplog):
    seen = []
    reporter = Reporter(logging.getLogger("rlhf.test"))

    def broken():
        raise OSError("store unreachable")

    reporter.submit("report of iteration 3", broken)
    reporter.submit("report of iteration 4", seen.append, 4)
    with caplog.at_level(logging.WARNING, logger="rlhf.test"):
        errors = reporter.close()
    assert errors == ["report of iteration 3 failed: OSError: store unreachable"]
    assert seen == [4] and "report of iteration 3 failed" in caplog.text


def test_the_queue_is_bounded_so_a_slow_reporter_holds_the_submitter_back():
    release, started = threading.Event(), threading.Event()
    reporter = Reporter(max_pending=1)
    reporter.submit("slow", lambda: (started.set(), release.wait(10)))
    started.wait(10)
    reporter.submit("queued", lambda: None)  # fills the one slot
    blocked = threading.Thread(target=reporter.submit, args=("third", lambda: None))
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive()  # waits for room instead of piling work up
    release.set()
    blocked.join(10)
    assert not blocked.is_alive() and reporter.close() == []


def _one_mlflow_call():
    with timing.timed("mlflow"):
        pass


def test_spans_logged_by_a_job_are_marked_background():
    """The overhead benchmark keeps them apart: they overlap the next iteration, not lengthen it."""
    timing.keep_spans()
    try:
        reporter = Reporter()
        reporter.submit("timed", _one_mlflow_call)
        reporter.close()
        _one_mlflow_call()
        marks = [(sp.kind, sp.background) for sp in timing.spans()]
    finally:
        timing.keep_spans(False)
    assert marks == [("mlflow", True), ("mlflow", False)]
