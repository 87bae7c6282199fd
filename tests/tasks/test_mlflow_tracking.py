"""MLflow tracking against the embedded SQLite store (real MLflow, no server)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rlhf_core.config import flatten, load_config
from rlhf_core.run.layout import RunDir
from tasks import mlflow_tracking


@pytest.fixture(scope="module")
def shared_home(tmp_path_factory):
    """One tracking store for the module: creating an SQLite store runs MLflow's migrations (seconds)."""
    return tmp_path_factory.mktemp("home")


@pytest.fixture
def run(tmp_path, shared_home, monkeypatch):
    monkeypatch.setenv("RLHF_HOME", str(shared_home))
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    return run


def test_embedded_store_lives_in_the_state_directory(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert mlflow_tracking.tracking_uri() == f"sqlite:///{Path(os.environ['RLHF_HOME']) / 'mlflow' / 'mlflow.db'}"
    assert mlflow_tracking.artifact_root() == (Path(os.environ["RLHF_HOME"]) / "mlflow" / "artifacts").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert mlflow_tracking.tracking_uri() == "http://127.0.0.1:5000" and mlflow_tracking.artifact_root() is None


def test_one_run_per_run_directory_with_config_params_and_batched_metrics(run, tmp_path):
    cfg = load_config(None, ["trainer.experiment_name=unit"])
    run_id = mlflow_tracking.start_pipeline_run(run, cfg)
    assert mlflow_tracking.params_of(run_id) == {k: str(v) for k, v in flatten(cfg).items()}
    assert mlflow_tracking.log_metrics(run_id, {"reward/mean": 0.5, "kl/mean": 0.01, "bad": float("nan")}, step=1) == 2
    mlflow_tracking.log_metrics(run_id, {"reward/mean": 0.7}, step=2)
    assert mlflow_tracking.metric_history(run_id, "reward/mean") == [(1, 0.5), (2, 0.7)]
    # a resume reopens the same run; a changed value becomes a tag (parameters are immutable)
    changed = load_config(None, ["trainer.experiment_name=unit", "actor_rollout_ref.actor.optim.lr=1e-7"])
    assert mlflow_tracking.start_pipeline_run(run, changed) == run_id
    assert mlflow_tracking.tags_of(run_id)["config_change/actor_rollout_ref.actor.optim.lr"] == "1e-06 -> 1e-07"
    png = tmp_path / "curve.png"
    png.write_bytes(b"\x89PNG fake")
    mlflow_tracking.log_artifact(run_id, png, "plots")
    assert [a.path for a in mlflow_tracking.client().list_artifacts(run_id, "plots")] == ["plots/curve.png"]
    mlflow_tracking.finish(run_id)
    assert mlflow_tracking.client().get_run(run_id).info.status == "FINISHED"


def test_stage_reruns_are_nested_under_the_pipeline_run(run):
    cfg = load_config(None, ["trainer.experiment_name=unit-nested"])
    parent = mlflow_tracking.start_pipeline_run(run, cfg)
    child = mlflow_tracking.start_stage_run(run, cfg, "score", 1)
    assert mlflow_tracking.tags_of(child)["mlflow.parentRunId"] == parent
    assert [r.info.run_id for r in mlflow_tracking.child_runs(parent)] == [child]
    assert mlflow_tracking.client().get_run(child).info.run_name == "score-iter1"


def test_a_wiped_store_starts_a_new_run(run, tmp_path, monkeypatch):
    cfg = load_config(None, ["trainer.experiment_name=unit"])
    first = mlflow_tracking.start_pipeline_run(run, cfg)
    monkeypatch.setenv("RLHF_HOME", str(tmp_path / "other-home"))
    assert mlflow_tracking.read_record(run) is None  # recorded against another store
    assert mlflow_tracking.start_pipeline_run(run, cfg) != first


def test_backfill_logs_committed_iterations_missing_from_mlflow_once(run):
    """A crash between an iteration's commit and its (background) report: the run directory has the
    metrics, MLflow not; the next flow run logs them, the same batch the report would have sent."""
    from rlhf_core.run.lifecycle import commit_iteration
    from rlhf_core.run.manifest import record_stage
    from tasks.iteration import backfill_metrics

    cfg = load_config(None, ["trainer.experiment_name=unit"])
    run_id = mlflow_tracking.start_pipeline_run(run, cfg)
    for k in (1, 2):
        record_stage(run, k, "rollout", status="done", inputs={}, outputs={}, config_hash="h",
                     metrics={"response_length/mean": 8.0 + k}, seconds=1.0)
        record_stage(run, k, "guard", status="done", inputs={}, outputs={}, config_hash="h",
                     metrics={"guard/kl_mean": 0.01 * k}, seconds=0.5)
        run.checkpoint(k).joinpath("actor").mkdir(parents=True)
        commit_iteration(run, k)
    record_stage(run, 3, "rollout", status="done", inputs={}, outputs={}, config_hash="h", metrics={}, seconds=1.0)
    mlflow_tracking.log_metrics(run_id, {"perf/iteration_seconds": 1.5, "kl/mean": 0.01}, step=1)  # 1 was reported

    assert backfill_metrics(cfg, run, run_id) == [2]  # 3 is not committed
    assert mlflow_tracking.metric_history(run_id, "response_length/mean") == [(2, 10.0)]
    assert mlflow_tracking.metric_history(run_id, "kl/mean") == [(1, 0.01), (2, 0.02)]  # the alias, as finish logs it
    assert [s for s, _ in mlflow_tracking.metric_history(run_id, "perf/stage_seconds/guard")] == [2]
    assert backfill_metrics(cfg, run, run_id) == []  # nothing logged twice


def test_verl_metric_names_reach_mlflow_spelled_as_verls_mlflow_logger_spells_them(run):
    """MLflow refuses '@': verl's own MLflow adapter writes mean@1 as mean_at_1; so do we."""
    assert mlflow_tracking.mlflow_key("val-core/openai/gsm8k/reward/mean@4") == "val-core/openai/gsm8k/reward/mean_at_4"
    assert mlflow_tracking.mlflow_key("val-aux/a//b/best@2/std") == "val-aux/a/b/best_at_2/std"
    run_id = mlflow_tracking.start_pipeline_run(run, load_config(None, ["trainer.experiment_name=unit"]))
    mlflow_tracking.log_metrics(run_id, {"val-core/openai/gsm8k/reward/mean@1": 0.25, "timing_s/gen": 1.5}, step=0)
    assert set(mlflow_tracking.client().get_run(run_id).data.metrics) == {"val-core/openai/gsm8k/reward/mean_at_1",
                                                                   "timing_s/gen"}
    assert mlflow_tracking.metric_history(run_id, "val-core/openai/gsm8k/reward/mean@1") == [(0, 0.25)]


def test_experiments_are_training_experiments_and_a_chosen_kind_is_kept(run):
    """MLflow 3 opens an experiment without a kind as a GenAI one (traces, evaluation runs)."""
    kind = "mlflow.experimentKind"
    made = mlflow_tracking.experiment_id("unit-kind-new")
    assert mlflow_tracking.client().get_experiment(made).tags[kind] == "custom_model_development"
    older = mlflow_tracking.client().create_experiment("unit-kind-older")  # as an earlier version created it
    assert mlflow_tracking.experiment_id("unit-kind-older") == older
    assert mlflow_tracking.client().get_experiment(older).tags[kind] == "custom_model_development"
    chosen = mlflow_tracking.client().create_experiment("unit-kind-chosen", tags={kind: "finetuning"})
    mlflow_tracking.experiment_id("unit-kind-chosen")
    assert mlflow_tracking.client().get_experiment(chosen).tags[kind] == "finetuning"


def test_the_printed_addresses_open_mlflows_training_view(run):
    """Issue 29: MLflow 3.17's UI opened the experiment on its GenAI traces view: it follows a
    workflow type chosen in its side bar (GenAI until switched), not the experiment's tag; the
    `workflowType` parameter of a link overrides it."""
    cfg = load_config(None, ["trainer.experiment_name=unit-view"])
    run_id = mlflow_tracking.start_pipeline_run(run, cfg)
    exp = mlflow_tracking.client().get_run(run_id).info.experiment_id
    assert mlflow_tracking.ui_path(run_id) == f"#/experiments/{exp}/runs/{run_id}?workflowType=machine_learning"


@pytest.mark.parametrize("server", ["mute", "closed"])
def test_a_mute_or_closed_tracking_server_costs_seconds_and_one_line(run, monkeypatch, caplog, server):
    """Issue 49, 10: a server that accepts connections and never answers held the run in
    start-tracking for 300 s and more before anything trained; a closed port ~4 min. Now it costs
    about 10 s, once: the run goes on untracked, said in one warning line."""
    import socket
    import threading
    import time

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    held = []
    if server == "mute":
        listener.listen(16)
        threading.Thread(target=lambda: [held.append(listener.accept()) for _ in range(16)], daemon=True).start()
    else:
        listener.close()
    for key in mlflow_tracking.HTTP_LIMITS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    started = time.monotonic()
    with caplog.at_level("WARNING"):
        assert mlflow_tracking.start_pipeline_run(run, load_config(None, [])) is None
    assert time.monotonic() - started < 30
    lines = [r.getMessage() for r in caplog.records if "MLflow tracking failed" in r.getMessage()]
    assert len(lines) == 1 and "the run goes on" in lines[0], lines
    listener.close()
