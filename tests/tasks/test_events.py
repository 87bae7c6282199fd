"""Alert events reach a person: a validation drop and a KL rollback/halt are emitted as Prefect
events, they arrive at a real Prefect server, and the automation of
deployments/automations/rlhf-alerts.yaml (created by deployments.alerts) fires on them: its
notification block POSTs to a webhook this test serves on 127.0.0.1."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import yaml

from deployments.alerts import AUTOMATION_FILE, automation_spec, create_alerting
from rlhf_core.config import load_config
from rlhf_core.run.layout import RunDir
from rlhf_core.run.report import ALERT_KINDS, dropped_from_best, iteration_alerts
from tasks.events import EVENT_PREFIX, NOTIFIED_KINDS, emit_alert, run_resource

REPO = Path(__file__).resolve().parents[2]


def _cfg(*overrides: str):
    return load_config(REPO / "configs" / "demo.yaml", list(overrides))


def test_val_drop_alerts_once_per_fall_and_rearms_on_a_new_best():
    assert dropped_from_best([0.5, 0.45], 0.1) is None  # within the allowed drop
    assert dropped_from_best([0.5, 0.39], 0.1) == 0.5
    assert dropped_from_best([0.5, 0.39, 0.3], 0.1) is None  # still down: already alerted
    assert dropped_from_best([0.5, 0.39, 0.6, 0.45], 0.1) == 0.6  # a new best re-arms it
    assert dropped_from_best([0.5, 0.3, None], 0.1) is None  # no validation this iteration
    cfg = _cfg()
    history = [{"val/accuracy": 0.7}, {"kl/mean": 0.01}]
    (alert,) = iteration_alerts(cfg.trainer, {"val/accuracy": 0.55, "kl/mean": 0.01}, history)
    assert alert.kind == "val-drop" and "0.150 below the run's best 0.700" in alert.message
    assert iteration_alerts(_cfg("trainer.alert_val_drop=null").trainer, {"val/accuracy": 0.1}, history) == []


def test_the_automation_file_expects_every_event_kind_we_emit():
    spec = yaml.safe_load(AUTOMATION_FILE.read_text())
    assert spec["trigger"]["expect"] == [EVENT_PREFIX + "*"]
    assert automation_spec("0" * 8)["actions"][0]["block_document_id"] == "0" * 8
    assert set(NOTIFIED_KINDS) == {"kl-breach", "val-drop", "old-log-prob-gap", "rollback", "halt"}


def test_every_warning_an_iteration_raises_can_be_emitted(tmp_path):
    """A committed iteration emits each warning-level alert it raises: a kind the report declares
    and the events refuse ended the run in tracebacks (the old-log-prob gap of a bf16 resume)."""
    warnings = [kind for kind, level in ALERT_KINDS.items() if level == "warning"]
    assert "old-log-prob-gap" in warnings
    for kind in warnings:
        emit_alert(RunDir(tmp_path / "run"), kind, 1, "a message")  # raised ValueError for an undeclared kind


class _Webhook(BaseHTTPRequestHandler):
    received: list = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        type(self).received.append(json.loads(body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):  # keep the test output to the test's own lines
        pass


@pytest.fixture
def webhook():
    server = HTTPServer(("127.0.0.1", 0), _Webhook)
    _Webhook.received = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/hook", _Webhook.received
    server.shutdown()


@pytest.mark.prefect
def test_events_arrive_and_the_automation_notifies(tmp_path, webhook):
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter
    from prefect.events.worker import EventsWorker
    from prefect.testing.utilities import prefect_test_harness

    url, received = webhook
    secret = "hf_" + "Zq8Lr2Wx" * 4  # a Hugging Face-style token in an override the message quotes
    run = RunDir(tmp_path / "runs" / "demo-run")
    with prefect_test_harness(server_startup_timeout=90):
        import prefect.settings
        from prefect.events.clients import PrefectEventsClient

        # Prefect keeps one events worker per process, bound to the server it first saw: an earlier
        # test's server (gone now) would get these events
        EventsWorker.set_client_override(PrefectEventsClient, api_url=prefect.settings.PREFECT_API_URL.value())
        try:
            create_alerting(url, kind="webhook")
            time.sleep(1.0)  # the trigger service reads new automations on its own loop
            emitted = [emit_alert(run, "val-drop", 3, "val/accuracy fell to 0.4"),
                       emit_alert(run, "halt", 4, f"halted: rlhf run --resume RUN trainer.project_name=team-{secret}",
                                  reason="x")]
            assert all(e is not None for e in emitted)
            EventsWorker.drain_all()
            names = set()
            with get_client(sync_client=True) as client:
                for _ in range(120):
                    page = client.request("POST", "/events/filter", json={"filter": EventFilter(
                        event=EventNameFilter(prefix=[EVENT_PREFIX]),
                        resource=EventResourceFilter(id=[run_resource(run)["prefect.resource.id"]]),
                    ).model_dump(mode="json")}).json()
                    names = {e["event"] for e in page["events"]}
                    stored = json.dumps(page["events"])
                    if len(names) == 2 and len(received) >= 2:
                        break
                    time.sleep(0.25)
        finally:
            EventsWorker.drain_all()
            EventsWorker.set_client_override(None)
    assert names == {"rlhf.alert.val-drop", "rlhf.alert.halt"}  # the events arrived
    assert secret not in stored and secret not in json.dumps(received) and "team-" in stored  # masked at this sink
    subjects = sorted(r["subject"] for r in received)  # and the automation fired once per event
    assert subjects == ["RLHF rlhf.alert.halt in demo-run", "RLHF rlhf.alert.val-drop in demo-run"], received
    assert any("iteration 3: val/accuracy fell to 0.4" in r["body"] for r in received)


def test_old_log_probs_taken_from_the_rollout_far_from_the_trainers_raise_an_alert():
    """The update's first step measures how far the old log-probs are from the trainer's own; taken from
    the rollout (rollout.old_log_probs=auto) they must be the trainer's arithmetic, so a gap over 1e-3
    is worth a person's attention, with the fix."""
    trainer = _cfg().trainer
    quiet = {"score/old_log_probs_from_rollout": 1.0, "actor/old_log_prob_diff_max": 1.9e-6}
    assert iteration_alerts(trainer, quiet) == []
    (alert,) = iteration_alerts(trainer, {**quiet, "actor/old_log_prob_diff_max": 0.016})
    assert alert.kind == "old-log-prob-gap" and "actor_rollout_ref.rollout.old_log_probs=recompute" in alert.message
    recomputed = {"score/old_log_probs_from_rollout": 0.0, "actor/old_log_prob_diff_max": 0.016}
    assert iteration_alerts(trainer, recomputed) == []  # the score stage's own pass: nothing to switch
