"""An induced KL breach (a learning rate 10,000× the demo's) in a real flow: the iteration is rolled back,
the last-good checkpoint stays byte-identical, the event is recorded everywhere; `halt` fails the
flow run with a way forward, `retry` (smaller learning rate) then completes the run."""

from __future__ import annotations

import hashlib

import pytest

from flows.pipeline import PipelineParams, rlhf_pipeline
from rlhf_core.run.lifecycle import KLGuardHalt
from rlhf_core.run.lifecycle import read_last_good
from rlhf_core.run.layout import RunDir
from rlhf_core.run.query import status_table
from tasks import mlflow_tracking

pytestmark = [pytest.mark.prefect, pytest.mark.slow, pytest.mark.deepspeed]

DEMO_LR = 1e-5  # configs/demo.yaml
TOO_HIGH = 10_000
"""One Adam step at 1000x still kept KL(actor‖ref) near 0.02 on the tiny model (measured), under the
0.05 threshold; 10,000x (lr 0.1) moves every weight by ~0.1 and breaches it by far."""


def tree_digest(path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def test_kl_breach_rolls_back_then_halts_or_retries(prefect_server, demo_preset, tiny_overrides, tmp_path,
                                                     monkeypatch):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    summary = rlhf_pipeline(PipelineParams(config=demo_preset, overrides=tiny_overrides(tmp_path / "runs"),
                                           iterations=1, run_name="kl"))
    run = RunDir(summary["run_dir"])
    run_id = summary["mlflow_run_id"]
    last_good_files = tree_digest(run.checkpoint(1))
    assert read_last_good(run)["iteration"] == 1

    # iteration 2 with a learning rate far too high, policy halt
    halt = [f"actor_rollout_ref.actor.optim.lr={DEMO_LR * TOO_HIGH}", "trainer.on_kl_breach=halt"]
    with pytest.raises(KLGuardHalt) as failure:
        rlhf_pipeline(PipelineParams(resume=str(run.root), overrides=halt, iterations=2))
    message = str(failure.value)
    assert "iteration 2" in message and "last-good is iteration 1" in message
    assert f"rlhf run --resume {run.root}" in message
    assert read_last_good(run)["iteration"] == 1 and not run.checkpoint(2).exists()
    assert tree_digest(run.checkpoint(1)) == last_good_files
    assert run.read_json(run.kl_ctrl_path) == run.read_json(run.kl_snapshot(2))["state"]
    kinds = [(e["kind"], e["iteration"]) for e in run.events()]
    assert ("rollback", 2) in kinds and ("halt", 2) in kinds
    assert _row(run, 2)["update"] == "rolled_back"
    mlrun = mlflow_tracking.client().get_run(run_id)
    assert mlrun.info.status == "FAILED" and mlrun.data.tags["rollback"] == "true"
    assert "rollback.iter_2.attempt_1" in mlrun.data.tags

    # resume with retry: the learning rate is divided back down and iteration 2 commits
    retry = ["trainer.on_kl_breach=retry", f"trainer.retry_lr_divisor={TOO_HIGH}", "trainer.max_rollbacks=1"]
    done = rlhf_pipeline(PipelineParams(resume=str(run.root), overrides=retry))
    assert done["last_good"]["iteration"] == 2 and done["mlflow_run_id"] == run_id
    assert tree_digest(run.checkpoint(1)) == last_good_files
    kinds = [e["kind"] for e in run.events() if e["iteration"] == 2]
    assert [kinds.count(k) for k in ("rollback", "halt", "retry", "commit")] == [2, 1, 1, 1]
    assert _row(run, 2)["guard"] == "committed" and _row(run, 2)["rollbacks"] == 2
    assert mlflow_tracking.client().get_run(run_id).info.status == "FINISHED"
    assert [s for s, v in mlflow_tracking.metric_history(run_id, "guard/rollback")] == [2, 2]
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["kl-kl-rollback"])))
    assert artifacts and "retry" in artifacts[0].data


def _row(run, iteration):
    """The status row of one iteration (iteration 0 holds the initial policy's validation)."""
    return {r["iteration"]: r for r in status_table(run)}[iteration]
