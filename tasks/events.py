"""Prefect events for what should reach a person: a committed iteration's KL breach and
validation drop (``rlhf_core.run.report.iteration_alerts``), a KL rollback and a halt
(``tasks.breach``). An Automation (deployments/automations/rlhf-alerts.yaml, created by
``python -m deployments.alerts``) turns them into a notification.

Every event is ``rlhf.alert.<kind>`` on the resource ``rlhf.run.<run name>``; Prefect adds the
flow run and task run it was emitted from as related resources. Its payload is
{"iteration", "message", "run_dir", ...}, secrets masked (``rlhf_core.security``).

Emitting never blocks a run: Prefect queues the event for its events worker, and without a
server to deliver to (``should_emit_events`` false) nothing is sent.
"""

from __future__ import annotations

from typing import Any, Optional

from prefect.events import Event, emit_event
from prefect.events.worker import emit_events_to_cloud, should_emit_events_to_running_server

from rlhf_core.run.layout import RunDir
from rlhf_core.run.report import ALERT_KINDS
from rlhf_core.security import redact_text, redact_value

EVENT_PREFIX = "rlhf.alert."
"""Every alert event's name starts with this (the automation's trigger expects ``rlhf.alert.*``)."""
NOTIFIED_KINDS = (*(kind for kind, level in ALERT_KINDS.items() if level == "warning"), "rollback", "halt")
"""The kinds emitted as events: every warning-level alert of a committed iteration (declared once, in
``report.ALERT_KINDS``), a rollback and a halt; the clip-fraction signal is information and stays in the log."""


def run_resource(run: RunDir) -> dict[str, str]:
    """The Prefect resource of a run directory: ``rlhf.run.<name>`` (what an automation matches)."""
    name = run.root.name
    return {"prefect.resource.id": f"rlhf.run.{name}", "prefect.resource.name": name}


def emit_alert(run: RunDir, kind: str, iteration: Optional[int], message: str, **details: Any) -> Optional[Event]:
    """Emit ``rlhf.alert.<kind>`` for ``run``; returns the event (None when Prefect emits nothing:
    no server configured). ``details`` join the payload."""
    if kind not in NOTIFIED_KINDS:
        raise ValueError(f"unknown alert event kind {kind!r}; valid: {', '.join(NOTIFIED_KINDS)}")
    if not (emit_events_to_cloud() or should_emit_events_to_running_server()):
        return None  # no server configured: Prefect would start an ephemeral one (~20 s) just for this event
    payload = {"iteration": iteration, "message": redact_text(message), "run_dir": redact_text(str(run.root)),
               **{key: redact_value(value) for key, value in details.items()}}
    return emit_event(EVENT_PREFIX + kind, resource=run_resource(run), payload=payload)
