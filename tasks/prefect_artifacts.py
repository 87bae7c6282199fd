"""What a run shows in the Prefect UI: artifacts (tables, markdown, progress) and the learning curve.

Artifacts are published only inside a Prefect run (``task.fn()`` in a unit test has no run to attach
them to, and skips them). Keyed artifacts (``<run>-metrics``, ``<run>-report``, ``<run>-progress``,
``<run>-kl-rollback``) keep a history across flow runs of the same run directory in the Artifacts page.

Every artifact and every Prefect log line passes ``rlhf_core.security``'s redaction on its way out
(``redact_prefect_logs`` puts it on Prefect's log handlers: the API's, which the UI shows, and the
console's), so a tracking URI's password or a token in an override never reaches the Prefect server.
"""

from __future__ import annotations

import base64
import logging
import re
from pathlib import Path
from typing import Any, Optional

from rlhf_core.run.layout import RunDir
from rlhf_core.io.timing import timed
from rlhf_core.control.query import metrics_table
from rlhf_core.run.report import CLIPFRAC_LOW
from rlhf_core.security import redact, redact_text

ARTIFACT, PLOT = "prefect_artifact", "plot"
"""``io.timing`` kinds of publishing Prefect artifacts and drawing the learning curve."""
CURVE_PANELS = (("reward/mean", "reward (mean)"), ("kl/mean", "KL(actor‖ref) per token"),
                ("actor/pg_clipfrac", "PPO clip fraction"), ("val/accuracy", "validation accuracy"))
TABLE_COLUMNS = ("reward/mean", "val/accuracy", "kl/mean", "kl/coef", "actor/pg_loss", "actor/pg_clipfrac",
                 "actor/ppo_kl", "actor/entropy", "actor/grad_norm", "critic/vf_loss", "critic/vf_clipfrac",
                 "response_length/mean", "perf/tokens_per_s", "perf/iteration_seconds")


def in_prefect_run() -> bool:
    try:
        from prefect.context import get_run_context

        get_run_context()
        return True
    except Exception:
        return False


class RedactingFilter(logging.Filter):
    """Masks secrets in a log record before any handler formats it: the message (arguments
    merged in) and the traceback text. The record is shared by every handler that sees it after."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            record.msg, record.args = redact_text(record.getMessage()), None
        except Exception:  # a malformed call: the handler reports it as logging does
            return True
        if record.exc_info and record.exc_info[1] is not None and not record.exc_text:
            record.exc_text = redact_text(logging.Formatter().formatException(record.exc_info))
        elif record.exc_text:
            record.exc_text = redact_text(record.exc_text)
        return True


def redact_prefect_logs() -> None:
    """Put ``RedactingFilter`` on every handler Prefect logs through (root, ``prefect`` and its
    run loggers), once. Called at the start of each flow: Prefect may have reconfigured logging
    since import."""
    from prefect.logging.handlers import APILogHandler, PrefectConsoleHandler

    names = ("", "prefect", "prefect.flow_runs", "prefect.task_runs", "prefect.extra")
    for handler in {h for name in names for h in logging.getLogger(name).handlers}:
        if isinstance(handler, (APILogHandler, PrefectConsoleHandler)) and not any(
                isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())


def logger() -> logging.Logger | logging.LoggerAdapter:
    """The Prefect run logger inside a run (shows in the UI), else a plain logger."""
    if in_prefect_run():
        from prefect import get_run_logger

        return get_run_logger()
    return logging.getLogger("rlhf")


def artifact_key(run: RunDir, suffix: str) -> str:
    """Prefect artifact keys: lowercase letters, digits and dashes only."""
    slug = re.sub(r"[^a-z0-9]+", "-", run.root.name.lower()).strip("-") or "run"
    return f"{slug}-{suffix}"


@timed(ARTIFACT)
def markdown(text: str, key: Optional[str] = None, description: Optional[str] = None) -> None:
    if in_prefect_run():
        from prefect.artifacts import create_markdown_artifact

        create_markdown_artifact(markdown=redact_text(text), key=key,
                                 description=None if description is None else redact_text(description))


@timed(ARTIFACT)
def table(rows: list[dict[str, Any]], key: Optional[str] = None, description: Optional[str] = None) -> None:
    if in_prefect_run() and rows:
        from prefect.artifacts import create_table_artifact

        create_table_artifact(table=[redact(row) for row in rows], key=key,
                              description=None if description is None else redact_text(description))


@timed(ARTIFACT)
def progress_start(run: RunDir, total: int, done: int = 0):
    if not in_prefect_run():
        return None
    from prefect.artifacts import create_progress_artifact

    return create_progress_artifact(progress=100.0 * done / max(total, 1), key=artifact_key(run, "progress"),
                                    description=f"iterations committed: {done}/{total}")


@timed(ARTIFACT)
def progress_update(artifact_id, done: int, total: int) -> None:
    if artifact_id is None or not in_prefect_run():
        return
    from prefect.artifacts import update_progress_artifact

    update_progress_artifact(artifact_id=artifact_id, progress=100.0 * done / max(total, 1),
                             description=f"iterations done: {done}/{total}")


def stage_markdown(result: dict) -> str:
    where = f" — iteration {result['iteration']}" if result.get("iteration") is not None else ""
    status = "skipped (inputs and config unchanged)" if result.get("skipped") else f"done in {result['seconds']:.1f} s"
    lines = [f"### {result['stage']}{where}: {status}", ""]
    lines += [f"- {line}" for line in result.get("summary", [])]
    if result.get("outputs"):
        lines += ["", "| output | path |", "|---|---|"]
        lines += [f"| {name} | `{path}` |" for name, path in result["outputs"].items()]
    if result.get("metrics"):
        lines += ["", "| metric | value |", "|---|---|"]
        lines += [f"| {name} | {value:.6g} |" for name, value in sorted(result["metrics"].items())]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# learning curve and per-iteration tables
# ---------------------------------------------------------------------------------------------


def metrics_by_iteration(run: RunDir) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for row in metrics_table(run).to_pylist():
        out.setdefault(row["iteration"], {})[row["name"]] = row["value"]
    return out


def curve_snapshot(run: RunDir, kl_threshold: Optional[float] = None) -> dict[str, Any]:
    """What the learning curve is drawn from, read now (``plot_learning_curve(run, out, **snapshot)``
    may then run later, on a background reporter, while the next iteration writes the run)."""
    return {"by_iter": metrics_by_iteration(run), "kl_threshold": kl_threshold,
            "rollbacks": sorted({e["iteration"] for e in run.events() if e.get("kind") == "rollback"})}


@timed(PLOT)
def plot_learning_curve(run: RunDir, out: Path, kl_threshold: Optional[float] = None,
                        by_iter: Optional[dict[int, dict[str, float]]] = None,
                        rollbacks: Optional[list[int]] = None) -> Path:
    """2×2 PNG of reward, KL (with the rollback threshold), clip fraction and validation accuracy
    against the iteration, from iter_*/metrics.json (or a ``curve_snapshot`` of them); rolled-back
    iterations marked with a red ×."""
    # the object API (no pyplot state) and a fixed layout: drawn every iteration, so it must be cheap
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if by_iter is None:
        by_iter = metrics_by_iteration(run)
    if rollbacks is None:
        rollbacks = sorted({e["iteration"] for e in run.events() if e.get("kind") == "rollback"})
    fig = Figure(figsize=(9, 6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2, sharex=True, gridspec_kw=dict(left=0.07, right=0.98, top=0.9, bottom=0.09,
                                                             hspace=0.25, wspace=0.18))
    for ax, (key, title) in zip(axes.flat, CURVE_PANELS):
        points = [(k, m[key]) for k, m in sorted(by_iter.items()) if key in m]
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", linewidth=1.5)
        if key == "actor/pg_clipfrac":
            fraction_axis(ax, [p[1] for p in points])
        if key == "val/accuracy":
            accuracy_intervals(ax, by_iter)
        if key == "kl/mean" and kl_threshold is not None:
            ax.axhline(kl_threshold, color="red", linestyle="--", linewidth=1, label="rollback threshold")
            ax.legend(loc="best", fontsize=8)
        for k in rollbacks:
            ax.axvline(k, color="red", alpha=0.15)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("iteration")
    fig.suptitle(run.root.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    return out


def accuracy_intervals(ax, by_iter: dict[int, dict[str, float]]) -> None:
    """The validation accuracies' 95 % intervals as a band, and the model before the warm start
    (``val_base/accuracy``, measured at iteration 0) as its own point with its interval."""
    band = [(k, m["val/accuracy_ci_low"], m["val/accuracy_ci_high"]) for k, m in sorted(by_iter.items())
            if "val/accuracy_ci_low" in m and "val/accuracy_ci_high" in m]
    if band:
        ax.fill_between([b[0] for b in band], [b[1] for b in band], [b[2] for b in band], alpha=0.2,
                        label="95 % interval")
    base = by_iter.get(0, {})
    if "val_base/accuracy" in base:
        low, high = base.get("val_base/accuracy_ci_low", base["val_base/accuracy"]), base.get(
            "val_base/accuracy_ci_high", base["val_base/accuracy"])
        ax.errorbar([0], [base["val_base/accuracy"]], yerr=[[base["val_base/accuracy"] - low],
                                                           [high - base["val_base/accuracy"]]],
                    fmt="s", color="grey", capsize=3, label="before the warm start")
    if band or "val_base/accuracy" in base:
        ax.legend(loc="best", fontsize=8)


def fraction_axis(ax, values: list[float]) -> None:
    """A fraction's axis starts at 0 (matplotlib centres a constant series on it: a flat 0 drawn
    between -0.05 and 0.05) and ends a little above the largest value; the clip-fraction alert's
    level is drawn when it is in view."""
    top = max(values, default=0.0)
    ax.set_ylim(0.0, top * 1.15 if top > 0 else 0.01)
    if top >= CLIPFRAC_LOW:
        ax.axhline(CLIPFRAC_LOW, color="orange", linestyle=":", linewidth=1, label="alert when it falls below")
        ax.legend(loc="best", fontsize=8)


def metrics_rows(run: RunDir) -> list[dict[str, Any]]:
    """Per-iteration table rows of the key metrics (None where absent)."""
    rows = []
    for k, m in sorted(metrics_by_iteration(run).items()):
        rows.append({"iteration": k, **{c: (round(m[c], 6) if c in m else None) for c in TABLE_COLUMNS}})
    return rows


def report_markdown(run: RunDir, png: Optional[Path], alerts: list[str], mlflow_url: Optional[str],
                    rows: Optional[list[dict[str, Any]]] = None) -> str:
    """The run report: header, alerts, the learning curve (inline PNG) and the metrics table
    (``rows``: ``metrics_rows(run)`` read earlier; read now when absent)."""
    lines = [f"# RLHF run `{run.root.name}`", "", f"Run directory: `{run.root}`"]
    if mlflow_url:
        lines.append(f"MLflow: {mlflow_url}")
    if alerts:
        lines += ["", "## Alerts", *[f"- ⚠️ {a}" for a in alerts]]
    if png is not None and png.is_file():
        data = base64.b64encode(png.read_bytes()).decode()
        lines += ["", "## Learning curve", "", f"![learning curve](data:image/png;base64,{data})"]
    rows = metrics_rows(run) if rows is None else rows
    if rows:
        cols = ["iteration", "reward/mean", "val/accuracy", "kl/mean", "actor/pg_clipfrac", "actor/grad_norm",
                "perf/iteration_seconds"]
        lines += ["", "## Metrics", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in rows:
            lines.append("| " + " | ".join("-" if r.get(c) is None else f"{r[c]:.4g}" for c in cols) + " |")
    return "\n".join(lines)
