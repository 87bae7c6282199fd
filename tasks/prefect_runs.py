"""Flow runs whose process is gone: Prefect learns of a crash only from the process itself, so a
flow run killed with SIGKILL (or with its machine) stays Running in the UI for good.

Two callers mark such runs Crashed: ``rlhf_pipeline``, at the start of every run of a run
directory (``claim_run_directory``), and ``python -m deployments.services down``, for the runs of a
worker it stopped (``mark_crashed``).

How a flow finds its predecessors: each flow run that writes a run directory records its id there
(a ``flow_run`` event in events.jsonl) while holding the directory's lock. The next flow run takes
that lock too, so every recorded flow run other than itself has ended; one still Pending or Running
in Prefect died without saying so.

Also here: the deployed flows' on_crashed hook (``fail_misplaced_parameters``), which turns the
crash of a flow run sent the form's fields outside ``params`` into a Failed state saying what to send;
and ``keep_command_sigterm``, which every flow calls first, so that a command's own SIGTERM handling
is not replaced by Prefect's for the flow's duration.
"""

from __future__ import annotations

import inspect
import json
import logging
import signal
import threading
from typing import Callable, Iterable, Optional

from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.filters import (
    FlowRunFilter, FlowRunFilterId, FlowRunFilterState, FlowRunFilterStateType, WorkPoolFilter, WorkPoolFilterName,
)
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.runtime import flow_run as current_flow_run
from prefect.flows import Flow
from prefect.states import Crashed, Failed

from rlhf_core.run.layout import RunDir
from rlhf_core.security import redact_text

FLOW_RUN_EVENT = "flow_run"
"""events.jsonl kind: a flow run that wrote this run directory (flow_run_id, flow_run_name)."""
UNFINISHED = (StateType.PENDING, StateType.RUNNING, StateType.CANCELLING)
"""States only the flow run's own process moves on from."""

log = logging.getLogger("rlhf.prefect_runs")
COMMAND_SIGTERM: Optional[Callable] = None
"""The SIGTERM handler of the command running flows in this process (`rlhf`: stop as Ctrl-C does,
resumable; ``rlhf_cli.orchestrated`` sets it); None elsewhere, e.g. a deployment's flow run, where
Prefect's own handler turns the worker's SIGTERM into a cancellation."""


def keep_command_sigterm() -> None:
    """Put ``COMMAND_SIGTERM`` back as the SIGTERM handler for the rest of this flow (main thread
    only; Prefect restores the command's handler when the flow ends anyway). Prefect's flow engine
    installs its own for a flow's duration, which first reports the crash to the server (retrying
    for minutes when that server went with the same signal: `timeout` kills the process group) and
    then ends the process without the command's line and resumable exit."""
    if COMMAND_SIGTERM is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, COMMAND_SIGTERM)


def unfinished(flow_run_ids: Iterable[str] = (), pool: Optional[str] = None) -> dict:
    """Filters for the flow runs still Pending/Running/Cancelling: among ``flow_run_ids``, or of the
    work pool ``pool``. Returns the keyword arguments of ``read_flow_runs``."""
    states = FlowRunFilterState(type=FlowRunFilterStateType(any_=list(UNFINISHED)))
    if pool is not None:
        return {"flow_run_filter": FlowRunFilter(state=states),
                "work_pool_filter": WorkPoolFilter(name=WorkPoolFilterName(any_=[pool]))}
    return {"flow_run_filter": FlowRunFilter(id=FlowRunFilterId(any_=list(flow_run_ids)), state=states)}


def mark_crashed(client: SyncPrefectClient, filters: dict, message: str) -> list[FlowRun]:
    """Set every flow run matching ``filters`` (see ``unfinished``) Crashed with ``message``;
    returns them. Forced: the server would refuse a Running → Crashed move from anyone but the run."""
    runs = client.read_flow_runs(**filters)
    for run in runs:
        client.set_flow_run_state(run.id, Crashed(message=message), force=True)
    return runs


def claim_run_directory(run: RunDir) -> list[str]:
    """In a flow run holding ``run``'s lock: mark the earlier flow runs of this directory that are
    still unfinished in Prefect Crashed (naming this run, which took over), then record this one.
    Returns the names of the runs marked. Best effort: a Prefect error is logged, never raised (the
    run directory, not Prefect, is the record of what ran)."""
    me, name = current_flow_run.id, current_flow_run.name
    if me is None:  # not in a flow run (e.g. a stage called directly): nothing to claim
        return []
    earlier = {e["flow_run_id"] for e in run.events() if e.get("kind") == FLOW_RUN_EVENT} - {me}
    marked: list[FlowRun] = []
    if earlier:
        message = (f"its process is gone (it ended without reporting a final state); found by flow run "
                   f"{name} ({me}), which continues {run.root}")
        try:
            with get_client(sync_client=True) as client:
                marked = mark_crashed(client, unfinished(earlier), message)
        except Exception as exc:  # the server's answer must not stop the run it is only reporting on
            log.warning("could not mark the earlier flow runs of %s Crashed: %s", run.root, exc)
    run.append_event(FLOW_RUN_EVENT, flow_run_id=me, flow_run_name=name,
                     **({"marked_crashed": [r.name for r in marked]} if marked else {}))
    return [r.name for r in marked]


def misplaced_fields(flow: Flow, parameters: dict) -> list[str]:
    """The top-level names in a flow run's ``parameters`` that ``flow``'s function does not take
    (e.g. ``config`` sent beside, not inside, the ``params`` form); [] when all of them fit."""
    return sorted(set(parameters or {}) - set(inspect.signature(flow.fn).parameters))


def flat_parameters_message(flow: Flow, parameters: dict) -> str:
    """What a caller who sent the form's fields at the top level should send instead (values
    redacted: the message lands in the flow run's state, the UI and the logs)."""
    stray = misplaced_fields(flow, parameters)
    nested = {"params": {name: parameters[name] for name in stray}}
    return redact_text(
        f"{flow.name} takes its form fields inside 'params', not at the top level (got {', '.join(stray)}). "
        f"REST: POST /api/deployments/<id>/create_flow_run with {{\"parameters\": {json.dumps(nested)}}}; "
        "UI: Run → Custom run and fill the fields of 'params'.")


def fail_misplaced_parameters(flow: Flow, flow_run: FlowRun, state) -> None:
    """on_crashed hook of the deployed flows. A flow run created with the form's fields at the top
    level is accepted by the server (the schema only checks what sits inside ``params``) and then
    crashes in Prefect's engine before any of our code runs ("Process exited with status code: 1",
    the cause only in the worker log). The worker runs this hook after that crash: the flow run is
    moved to Failed with a state message saying what to send. Any other crash is left as it is."""
    if not misplaced_fields(flow, flow_run.parameters):
        return
    message = flat_parameters_message(flow, flow_run.parameters)
    with get_client(sync_client=True) as client:  # Crashed is final: only a forced state replaces it
        client.set_flow_run_state(flow_run.id, Failed(message=message), force=True)
    log.error("flow run %s: %s", flow_run.name, message)
