"""A deployment run whose form fields were sent at the top level (``{"parameters": {"config": ...,
"iterations": 3}}``) instead of inside ``params``: the server accepts it, Prefect's engine crashes
before our code runs, and the worker's on_crashed hook turns the Crash into a Failed state whose
message says what to send. Against a real Prefect server: in the default suite the engine's
``run_flow`` and the worker's hook runner are called in this process (~20 s); with ``-m server``
also through a real process worker and flow-run process (1-3 minutes on two busy cores)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from flows.pipeline import rlhf_pipeline
from flows.retrain import rlhf_retrain
from tasks.prefect_runs import flat_parameters_message, misplaced_fields

pytestmark = [pytest.mark.prefect, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
POOL = "flat-params-test"


def test_the_message_shows_the_nested_form_for_both_flows():
    sent = {"config": "configs/demo.yaml", "iterations": 3, "overrides": ["trainer.project_name=hf_" + "a1B2" * 8]}
    for flow in (rlhf_pipeline, rlhf_retrain):
        assert misplaced_fields(flow, sent) == ["config", "iterations", "overrides"]
        message = flat_parameters_message(flow, sent)
        assert '"params": {"config": "configs/demo.yaml", "iterations": 3' in message
        assert "a1B2a1B2" not in message  # a secret in an override is masked in the state message
        assert "Custom run" in message
    assert misplaced_fields(rlhf_pipeline, {"params": {"config": "configs/demo.yaml"}}) == []


async def _flat_flow_run(client, parameters: dict):
    """A flow run of an rlhf-train deployment (the entrypoint and schema `prefect deploy` records),
    created through the REST API with ``parameters``."""
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.utilities.callables import parameter_schema

    await client.create_work_pool(WorkPoolCreate(name=POOL, type="process"), overwrite=True)
    flow_id = await client.create_flow_from_name(rlhf_pipeline.name)
    deployment_id = await client.create_deployment(
        flow_id=flow_id, name="rlhf-train", entrypoint="flows/pipeline.py:rlhf_pipeline", path=str(REPO),
        work_pool_name=POOL, enforce_parameter_schema=True,
        parameter_openapi_schema=parameter_schema(rlhf_pipeline).model_dump())
    return await client.create_flow_run_from_deployment(deployment_id, parameters=parameters)


async def _engine_then_hooks(parameters: dict) -> tuple:
    """What the flow-run process and then the worker do, in this process: the engine's run_flow on
    the flow run (it raises before any of our code), the Crashed state the worker reports for the
    exit, then the worker's hook runner with the worker's flow loader."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import SignatureMismatchError
    from prefect.flow_engine import run_flow
    from prefect.flows import load_flow_from_flow_run
    from prefect.runner._hook_runner import HookRunner
    from prefect.states import Crashed

    async with get_client() as client:
        flow_run = await _flat_flow_run(client, parameters)
        with pytest.raises(SignatureMismatchError):
            run_flow(rlhf_pipeline, flow_run=flow_run)
        crashed = Crashed(message="Process exited with status code: 1. Process exited with a general error.")
        await client.set_flow_run_state(flow_run.id, crashed, force=True)
        flow_run = await client.read_flow_run(flow_run.id)
        await HookRunner(resolve_flow=load_flow_from_flow_run).run_crashed_hooks(flow_run, flow_run.state)
        return flow_run, (await client.read_flow_run(flow_run.id)).state


async def _run_once(parameters: dict) -> tuple:
    from prefect.client.orchestration import get_client
    from prefect.workers.process import ProcessWorker

    async with get_client() as client:
        flow_run = await _flat_flow_run(client, parameters)
        async with ProcessWorker(work_pool_name=POOL, prefetch_seconds=0) as worker:
            await worker.get_and_submit_flow_runs()
            for _ in range(240):  # the worker's task group runs the flow run process and then the hook
                state = (await client.read_flow_run(flow_run.id)).state
                if state.is_final() and not state.is_crashed():
                    break
                await asyncio.sleep(0.25)
        return flow_run, (await client.read_flow_run(flow_run.id)).state


def _assert_failed_with_what_to_send(flow_run, state) -> None:
    assert flow_run.parameters == {"config": "configs/demo.yaml", "iterations": 3}  # the server took it
    assert state.is_failed(), (state.type, state.message)
    assert "inside 'params'" in state.message and "(got config, iterations)" in state.message
    sent = json.loads(state.message.split(" with ", 1)[1].split("; UI:", 1)[0])
    assert sent == {"parameters": {"params": {"config": "configs/demo.yaml", "iterations": 3}}}


def test_flat_parameters_fail_the_flow_run_with_what_to_send(prefect_server):
    _assert_failed_with_what_to_send(*asyncio.run(_engine_then_hooks({"config": "configs/demo.yaml", "iterations": 3})))


@pytest.mark.server
def test_through_a_real_process_worker(prefect_server, request):
    if "server" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("a flow-run process and a worker (1-3 minutes): run with -m server")
    _assert_failed_with_what_to_send(*asyncio.run(_run_once({"config": "configs/demo.yaml", "iterations": 3})))
