"""A deployment run whose form fields were sent at the top level (``{"parameters": {"config": ...,
"iterations": 3}}``) instead of inside ``params``: the server accepts it, Prefect's engine crashes
before our code runs, and the worker's on_crashed hook turns the Crash into a Failed state whose
message says what to send. Against a real Prefect server with a real process worker."""

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


async def _run_once(parameters: dict) -> tuple:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.utilities.callables import parameter_schema
    from prefect.workers.process import ProcessWorker

    async with get_client() as client:
        await client.create_work_pool(WorkPoolCreate(name=POOL, type="process"), overwrite=True)
        flow_id = await client.create_flow_from_name(rlhf_pipeline.name)
        deployment_id = await client.create_deployment(
            flow_id=flow_id, name="rlhf-train", entrypoint="flows/pipeline.py:rlhf_pipeline", path=str(REPO),
            work_pool_name=POOL, enforce_parameter_schema=True,
            parameter_openapi_schema=parameter_schema(rlhf_pipeline).model_dump())
        flow_run = await client.create_flow_run_from_deployment(deployment_id, parameters=parameters)
        async with ProcessWorker(work_pool_name=POOL, prefetch_seconds=0) as worker:
            await worker.get_and_submit_flow_runs()
            for _ in range(240):  # the worker's task group runs the flow run process and then the hook
                state = (await client.read_flow_run(flow_run.id)).state
                if state.is_final() and not state.is_crashed():
                    break
                await asyncio.sleep(0.25)
        return flow_run, (await client.read_flow_run(flow_run.id)).state


def test_flat_parameters_fail_the_flow_run_with_what_to_send(prefect_test_server):
    flow_run, state = asyncio.run(_run_once({"config": "configs/demo.yaml", "iterations": 3}))
    assert flow_run.parameters == {"config": "configs/demo.yaml", "iterations": 3}  # the server took it
    assert state.is_failed(), (state.type, state.message)
    assert "inside 'params'" in state.message and "(got config, iterations)" in state.message
    sent = json.loads(state.message.split(" with ", 1)[1].split("; UI:", 1)[0])
    assert sent == {"parameters": {"params": {"config": "configs/demo.yaml", "iterations": 3}}}


@pytest.fixture(scope="module")
def prefect_test_server():
    """A temporary Prefect server for this module (the deployments' services stack is minutes)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90):
        yield
