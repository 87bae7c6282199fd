"""Prefect-side reporting helpers outside a run: the learning curve, tables, the report, retry rule."""

from __future__ import annotations

from prefect.states import Failed

from rlhf_core.io.atomic import atomic_write_json
from rlhf_core.run.layout import RunDir
from tasks import prefect_artifacts
from tasks.stages import transient_io_error


def _run_with_metrics(tmp_path):
    run = RunDir(tmp_path / "My Run_1")
    for k, (reward, kl) in enumerate([(0.1, 0.01), (0.3, 0.02), (0.4, 0.09)], start=1):
        metrics = {"reward/mean": reward, "kl/mean": kl, "actor/pg_clipfrac": 0.2}
        if k != 2:
            metrics["val/accuracy"] = reward / 2
        atomic_write_json(run.metrics(k), metrics)
    run.append_event("rollback", 3, kl=0.09)
    return run


def test_learning_curve_png(tmp_path):
    import matplotlib.image as mpimg

    run = _run_with_metrics(tmp_path)
    png = prefect_artifacts.plot_learning_curve(run, tmp_path / "plots" / "curve.png", kl_threshold=0.05)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = mpimg.imread(png).shape
    assert width > 600 and height > 400


def test_metrics_rows_and_report(tmp_path):
    run = _run_with_metrics(tmp_path)
    rows = prefect_artifacts.metrics_rows(run)
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert rows[1]["val/accuracy"] is None and rows[2]["kl/mean"] == 0.09
    png = prefect_artifacts.plot_learning_curve(run, tmp_path / "curve.png")
    text = prefect_artifacts.report_markdown(run, png, ["KL 0.09 above threshold"], None)
    assert "data:image/png;base64," in text and "⚠️ KL 0.09 above threshold" in text
    assert "| 3 | 0.4 | 0.2 | 0.09 |" in text


def test_artifact_keys_are_prefect_safe(tmp_path):
    run = _run_with_metrics(tmp_path)
    assert prefect_artifacts.artifact_key(run, "metrics") == "my-run-1-metrics"


def test_outside_a_prefect_run_artifacts_are_skipped(tmp_path):
    assert not prefect_artifacts.in_prefect_run()
    prefect_artifacts.markdown("# nothing to attach to")  # no server is contacted, nothing raised
    assert prefect_artifacts.progress_start(_run_with_metrics(tmp_path), 3) is None


def test_only_transient_io_errors_are_retried():
    assert transient_io_error(None, None, Failed(data=OSError(5, "Input/output error")))
    assert not transient_io_error(None, None, Failed(data=FileNotFoundError("prompts/train.parquet")))
    assert not transient_io_error(None, None, Failed(data=ValueError("a bug")))


def test_clip_fraction_axis_starts_at_zero_even_when_flat():
    """A constant 0 was centred on the axis (-0.05 … 0.05); a fraction's axis starts at 0, and the
    alert level shows once the values reach it."""
    from matplotlib.figure import Figure

    flat, moving = Figure().subplots(1, 2)
    flat.plot([1, 2, 3], [0.0, 0.0, 0.0])
    prefect_artifacts.fraction_axis(flat, [0.0, 0.0, 0.0])
    assert flat.get_ylim() == (0.0, 0.01) and not flat.get_legend()
    prefect_artifacts.fraction_axis(moving, [0.05, 0.2])
    assert moving.get_ylim() == (0.0, 0.2 * 1.15) and [line.get_ydata()[0] for line in moving.lines] == [0.1]


def test_published_artifacts_and_log_lines_are_redacted():
    """The sinks' own redaction: a Prefect log record (message, arguments, traceback) and an
    artifact's text; the report's inline learning curve is kept whole."""
    import logging
    import sys

    uri = "http://ann:Pw7q9zLmX2@127.0.0.1:5055"
    try:
        raise ConnectionError(f"API request to {uri}/api/2.0/mlflow/runs/get failed")
    except ConnectionError:
        record = logging.LogRecord("prefect.task_runs", logging.ERROR, __file__, 1, "MLflow run %s in %s",
                                   ("abc", uri), sys.exc_info())
    assert prefect_artifacts.RedactingFilter().filter(record)
    text = logging.Formatter().format(record)
    assert "Pw7q9zLmX2" not in text and "MLflow run abc in http://ann:***@127.0.0.1:5055" in text
    assert "ConnectionError: API request to http://ann:***@" in text
