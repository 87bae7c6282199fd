"""No secret reaches any sink, through the real entry points: `rlhf run` and `rlhf stage` against a
real MLflow tracking server (MLflow's own server app, served on a free loopback port by this test
process, SQLite store) whose URI carries a password, with a Hugging Face-style token in the project
name, on the session's real Prefect test server.

Sinks checked: RUN/tracking.json, the flow run's Prefect logs, its artifacts and its recorded
parameters, the console (the closing block, and MLflow's own "View run at" line), the MLflow run's
tags and parameters. Then a skipped stage rerun records nothing (no nested MLflow run, no alert), and
the MLflow experiment is a training experiment (MLflow 3's experiment kind)."""

from __future__ import annotations

import contextlib
import io
import os
import json
import threading

import pytest

from rlhf_core.run.layout import RunDir
from tasks import mlflow_tracking

pytestmark = [pytest.mark.prefect, pytest.mark.slow, pytest.mark.deepspeed]

PASSWORD = "Pw7q9zLmX2"
TOKEN = "hf_" + "Q3xv9LmZ0pR7sT2uW5yB8cD1eF4gH6"


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """MLflow's tracking server app (mlflow.server.app, what its CLI serves) on 127.0.0.1, in a thread;
    yields the tracking URI with a user and PASSWORD in it (the server, without auth, ignores them)."""
    from werkzeug.serving import make_server

    store = tmp_path_factory.mktemp("mlflow-server")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("_MLFLOW_SERVER_FILE_STORE", f"sqlite:///{store / 'mlflow.db'}")
        mp.setenv("_MLFLOW_SERVER_ARTIFACT_ROOT", str(store / "artifacts"))
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)  # restored on exit: the store's start below sets it
        from mlflow.server import app
        from mlflow.server.handlers import _get_tracking_store

        _get_tracking_store()  # what the server does on its first request, done now: it points this process's
        # MLflow at its own store, which a client process would not see; popped, not mp.delenv: the undo
        # would put the store's URI back for every later test in this process
        os.environ.pop("MLFLOW_TRACKING_URI", None)
        server = make_server("127.0.0.1", 0, app, threaded=True)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://ann:{PASSWORD}@127.0.0.1:{server.server_port}"
        finally:
            server.shutdown()
            import mlflow

            mlflow.set_tracking_uri(None)  # the store's start set MLflow's process-wide URI: later tests must not see it


@pytest.fixture(scope="module")
def tracked(mlflow_server, prefect_server, demo_preset, tiny_overrides, shared_home, tmp_path_factory):
    """One iteration by `rlhf run`, its console output captured."""
    from rlhf_cli.main import main

    runs = tmp_path_factory.mktemp("runs")
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLHF_HOME", str(shared_home))
        mp.setenv("MLFLOW_TRACKING_URI", mlflow_server)
        with contextlib.redirect_stdout(out):
            code = main(["run", "-c", demo_preset, *tiny_overrides(runs, f"trainer.project_name=team-{TOKEN}",
                                                                   "trainer.val_before_train=false"),
                         "--iterations", "1", "--run-name", "secret"])
    assert code == 0, out.getvalue()
    return RunDir(runs / "secret"), out.getvalue()


def _flow_run(name: str):
    """The latest flow run of that name."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with get_client(sync_client=True) as client:
        found = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))
    return max(found, key=lambda r: r.created)


def _prefect_texts(flow_run_id) -> tuple[str, str]:
    """(every log line of the flow run and its task runs, every artifact's data and description)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)  # the API handler sends its records in batches, from a background worker
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200)
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    return ("\n".join(r.message for r in logs),
            "\n".join(f"{a.key} {a.description} {json.dumps(a.data)}" for a in artifacts))


def _leaks(text: str) -> list[str]:
    return [secret for secret in (PASSWORD, TOKEN) if secret in text]


def test_no_secret_in_any_sink_of_a_tracked_run(tracked, mlflow_server, monkeypatch):
    run, console = tracked
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    shown = mlflow_server.replace(PASSWORD, "***")

    record = json.loads((run.root / "tracking.json").read_text())
    assert record["tracking_uri"] == shown  # and a resume still finds its run (compared masked)
    assert mlflow_tracking.read_record(run)["run_id"] == record["run_id"]

    flow_run = _flow_run("run-secret")
    logs, artifacts = _prefect_texts(flow_run.id)
    assert f"MLflow run {record['run_id']} in {shown}" in logs
    assert not _leaks(logs) and not _leaks(artifacts)
    assert f"{shown}/#/experiments/" in artifacts  # the report's MLflow link, masked
    assert "data:image/png;base64," in artifacts  # the learning curve survives the redaction
    overrides = flow_run.parameters["params"]["overrides"]
    assert not _leaks(json.dumps(overrides)) and "trainer.project_name=team-***" in overrides

    assert "View run" not in console and not _leaks(console)  # MLflow's own line is off; ours is masked
    assert f"MLflow          run {record['run_id']}: {shown}/#/experiments/" in console

    mlrun = mlflow_tracking.client().get_run(record["run_id"])
    assert not _leaks(json.dumps(mlrun.data.tags)) and not _leaks(json.dumps(mlrun.data.params))
    assert mlrun.data.tags["rlhf.project"] == "team-***"
    experiment = mlflow_tracking.client().get_experiment(mlrun.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # not a GenAI experiment


def test_a_skipped_stage_rerun_records_nothing_and_a_forced_one_is_masked(tracked, mlflow_server, shared_home,
                                                                          monkeypatch):
    from rlhf_cli.main import main

    run, _ = tracked
    monkeypatch.setenv("RLHF_HOME", str(shared_home))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    parent = mlflow_tracking.read_record(run)["run_id"]
    events, closed = len(run.events()), run.iteration_metrics(1).stat().st_mtime_ns
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # the threshold would make the iteration's KL an alert, were it re-closed
        assert main(["stage", "gae", "--run-dir", str(run.root), "--iteration", "1",
                     "trainer.kl_rollback_threshold=1e-9"]) == 0
    assert "skipped (up to date)" in out.getvalue()
    assert mlflow_tracking.child_runs(parent) == []
    assert [e for e in run.events()[events:] if e["kind"] == "alert"] == []
    assert run.iteration_metrics(1).stat().st_mtime_ns == closed  # not re-closed: no iteration report either

    with contextlib.redirect_stdout(out):
        assert main(["stage", "gae", "--run-dir", str(run.root), "--iteration", "1", "--force"]) == 0
    (child,) = mlflow_tracking.child_runs(parent)
    assert child.info.run_name == "gae-iter1" and child.info.status == "FINISHED"
    assert "perf/stage_seconds/gae" in child.data.metrics  # the stage's own numbers, logged once it did work
    assert not _leaks(out.getvalue()) and not _leaks(json.dumps(child.data.tags))
    logs, artifacts = _prefect_texts(_flow_run("gae-iter1").id)
    assert "MLflow run" in logs and not _leaks(logs) and not _leaks(artifacts)
