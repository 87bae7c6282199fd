"""The whole pipeline flow, 2 iterations on the tiny model (``two_iterations``, tests/flows/conftest.py):
real Prefect (test server), real MLflow (SQLite), real DeepSpeed on CPU. Then a CLI rerun of one
stage on the finished run."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from rlhf_core.config import flatten
from rlhf_core.control.plan import resolve_run_config
from rlhf_core.control.query import read_iteration_metrics
from rlhf_core.control.status import status_table
from tasks import mlflow_tracking

pytestmark = [pytest.mark.prefect, pytest.mark.slow, pytest.mark.deepspeed]

EVERY_ITERATION = ("reward/mean", "kl/mean", "kl/coef", "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl",
                   "actor/entropy", "actor/grad_norm", "critic/vf_loss", "critic/vf_clipfrac", "response_length/mean",
                   "perf/tokens_per_s", "perf/stage_seconds/rollout", "perf/stage_seconds/score",
                   "perf/stage_seconds/gae", "perf/stage_seconds/update", "perf/stage_seconds/guard")


def _prefect_artifact_keys(prefix: str) -> set[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(like_=prefix)))
    return {a.key for a in found}


def test_two_iterations_complete_with_their_records(two_iterations, monkeypatch):
    monkeypatch.setenv("RLHF_HOME", str(two_iterations.home))
    run = two_iterations.run
    assert two_iterations.summary["last_good"]["iteration"] == 2
    rows = {r["iteration"]: r for r in status_table(run)}
    for k in (1, 2):
        assert [rows[k][s] for s in ("rollout", "score", "gae", "update", "guard")] == \
            ["done", "done", "done", "done", "committed"]
    assert "val/accuracy" in read_iteration_metrics(run, 2) and "val/accuracy" not in read_iteration_metrics(run, 1)
    assert (run.root / "export" / "actor" / "config.json").is_file()

    run_id = two_iterations.summary["mlflow_run_id"]
    mlrun = mlflow_tracking.client().get_run(run_id)
    assert mlrun.info.status == "FINISHED" and mlrun.info.run_name == "two"
    cfg = resolve_run_config(run.root, None, [])
    assert set(flatten(cfg)) <= set(mlrun.data.params)
    for key in EVERY_ITERATION:
        assert [step for step, _ in mlflow_tracking.metric_history(run_id, key)] == [1, 2], key
    # step 0 is the initial policy's baseline, then every trainer.test_freq iterations and the last
    assert [step for step, _ in mlflow_tracking.metric_history(run_id, "val/accuracy")] == [0, 2]
    assert [a.path for a in mlflow_tracking.client().list_artifacts(run_id, "plots")] == ["plots/learning_curve.png"]

    assert {"two-metrics", "two-report", "two-progress", "two-export"} <= _prefect_artifact_keys("two-%")
    # published by the background reporter, still attached to the flow run; one stage summary per iteration
    flow_run = _flow_run_named("run-two")
    assert {a.key: a.flow_run_id for a in _artifacts_of(flow_run)}.get("two-report") == flow_run
    summaries = [a.description for a in _artifacts_of(flow_run) if (a.description or "").startswith("stages of")]
    assert sorted(summaries) == ["stages of iteration 1", "stages of iteration 2"]


def _flow_run_named(name: str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with get_client(sync_client=True) as client:
        (found,) = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))
    return found.id


def _artifacts_of(flow_run_id) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))


def test_cli_rerun_of_score_reproduces_the_table(two_iterations, monkeypatch, capsys):
    from rlhf_cli.main import main

    monkeypatch.setenv("RLHF_HOME", str(two_iterations.home))
    run = two_iterations.run
    before = pq.read_table(run.scored(1))
    argv = ["stage", "score", "--run-dir", str(run.root), "--iteration", "1"]
    assert main(argv) == 0
    assert "[score iteration 1] skipped (up to date)" in capsys.readouterr().out
    assert main(argv + ["--force"]) == 0
    out = capsys.readouterr().out
    assert "[score iteration 1] done" in out and "nothing downstream is stale" in out  # the same bytes
    assert pq.read_table(run.scored(1)).equals(before)
    rows = {r["iteration"]: r for r in status_table(run)}
    assert [rows[1][s] for s in ("score", "gae", "update")] == ["done", "done", "done"]
    assert rows[2]["rollout"] == "done"
    nested = mlflow_tracking.child_runs(two_iterations.summary["mlflow_run_id"])
    assert {r.info.run_name for r in nested} == {"score-iter1"}


def test_guard_rerun_on_a_committed_iteration_only_records_its_verdict(two_iterations, monkeypatch, capsys):
    from rlhf_cli.main import main
    from rlhf_core.run.lifecycle import read_verdict
    from rlhf_core.run.lifecycle import read_last_good

    monkeypatch.setenv("RLHF_HOME", str(two_iterations.home))
    run = two_iterations.run
    checkpoint = sorted(p.name for p in (run.checkpoint(2) / "actor").iterdir())
    argv = ["stage", "guard", "--run-dir", str(run.root), "--iteration", "2", "trainer.kl_rollback_threshold=1e-12"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "→ rollback" in out and "guard verdict applied: recorded" in out
    assert read_verdict(run, 2)["decision"] == "rollback"
    assert read_last_good(run)["iteration"] == 2
    assert sorted(p.name for p in (run.checkpoint(2) / "actor").iterdir()) == checkpoint
    assert {r["iteration"]: r for r in status_table(run)}[2]["guard"] == "committed"
    assert not [e for e in run.events() if e["kind"] == "rollback"]
