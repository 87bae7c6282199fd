"""An induced KL breach (a learning rate 10,000× the demo's) in a real flow: the iteration is rolled back,
the last-good checkpoint stays byte-identical, the event is recorded everywhere (the Prefect alert
events rlhf.alert.rollback / rlhf.alert.halt included, read back from the test server); `halt` fails
the flow run with a way forward, `retry` (smaller learning rate) then completes the run."""

from __future__ import annotations

import hashlib
import time

import pytest

from flows.pipeline import PipelineParams, rlhf_pipeline
from rlhf_core.run.lifecycle import KLGuardHalt
from rlhf_core.run.lifecycle import read_last_good
from rlhf_core.run.layout import RunDir
from rlhf_core.control.status import status_table
from tasks import mlflow_tracking
from tasks.events import EVENT_PREFIX, run_resource

pytestmark = [pytest.mark.prefect, pytest.mark.slow, pytest.mark.deepspeed]

DEMO_LR = 1e-5  # configs/demo.yaml
TOO_HIGH = 10_000
"""One Adam step at 1000x still kept KL(actor‖ref) near 0.02 on the tiny model (measured), under the
0.05 threshold; 10,000x (lr 0.1) moves every weight by ~0.1 and breaches it by far."""


def tree_digest(path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def test_kl_breach_rolls_back_then_halts_or_retries(prefect_server, demo_preset, tiny_overrides, tmp_path,
                                                     monkeypatch, events_to_this_server):
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
    assert _row(run, 2)["gae"] == "rolled_back"  # the KL controller state it wrote is nobody's to start from
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
    # the retry started from committed iteration 1's KL controller state, its coefficient doubled
    kl = run.read_json(run.kl_state(2))
    assert kl["used"] == run.read_json(run.kl_state(1))["next"] and kl["retry_scale"] == 2.0
    assert run.read_json(run.retry_record(2))["kl_coef_scale"] == 2.0
    assert "kl_coef_scale" not in run.config_path.read_text()  # β is not config
    assert mlflow_tracking.client().get_run(run_id).info.status == "FINISHED"
    assert [s for s, v in mlflow_tracking.metric_history(run_id, "guard/rollback")] == [2, 2]
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["kl-kl-rollback"])))
    assert artifacts and "retry" in artifacts[0].data

    # the alerts that reach a person: one rollback event per rollback (its decision in the payload)
    # and one halt event carrying the way forward, each tied to the flow run that emitted it
    alerts = _alert_events(run, expected=3)
    rollbacks = [e for e in alerts if e["event"] == "rlhf.alert.rollback"]
    (halted,) = [e for e in alerts if e["event"] == "rlhf.alert.halt"]
    assert sorted(e["payload"]["decision"] for e in rollbacks) == ["halt", "retry"], alerts
    assert {e["payload"]["iteration"] for e in rollbacks + [halted]} == {2}
    assert all("KL(actor‖ref)" in e["payload"]["message"] for e in rollbacks)
    assert halted["payload"]["reason"] == "trainer.on_kl_breach=halt"
    assert f"rlhf run --resume {run.root}" in halted["payload"]["message"]
    assert all(any(r["prefect.resource.id"].startswith("prefect.flow-run.") for r in e["related"]) for e in alerts)


@pytest.fixture
def events_to_this_server(prefect_server):
    """Prefect keeps one events worker per process, bound to the first server it sent to: an earlier
    test's server (gone now) would otherwise get this test's events."""
    from prefect.events.clients import PrefectEventsClient
    from prefect.events.worker import EventsWorker

    EventsWorker.set_client_override(PrefectEventsClient, api_url=prefect_server)
    try:
        yield
    finally:
        EventsWorker.drain_all()
        EventsWorker.set_client_override(None)


def _alert_events(run: RunDir, expected: int, timeout_s: float = 30.0) -> list[dict]:
    """The rlhf.alert.* events of ``run`` stored by the server, once at least ``expected`` arrived
    (the events worker delivers them in the background)."""
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all()
    query = EventFilter(event=EventNameFilter(prefix=[EVENT_PREFIX]),
                        resource=EventResourceFilter(id=[run_resource(run)["prefect.resource.id"]]))
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            found = client.request("POST", "/events/filter", json={"filter": query.model_dump(mode="json")}).json()
            if len(found["events"]) >= expected or time.monotonic() > deadline:
                return found["events"]
            time.sleep(0.25)


def _row(run, iteration):
    """The status row of one iteration (iteration 0 holds the initial policy's validation)."""
    return {r["iteration"]: r for r in status_table(run)}[iteration]
