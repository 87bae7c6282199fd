"""A pipeline process killed with SIGKILL mid-iteration cannot tell Prefect: its flow run stays
Running. The resume of its run directory marks it Crashed, saying which flow run took over."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
from prefect.client.schemas.objects import StateType

from flows.pipeline import PipelineParams, rlhf_pipeline

pytestmark = [pytest.mark.prefect, pytest.mark.slow, pytest.mark.deepspeed]

NAME = "sigkilled-mid-iteration"  # flow run names are per run name: unique in the session's server


def _flow_runs(name: str) -> list:
    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            pytest.fail(f"rlhf run ended (rc {proc.returncode}) before {path} appeared:\n{proc.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{path} did not appear within {timeout} s")
        time.sleep(0.2)


def test_resume_marks_the_killed_flow_run_crashed(prefect_server, demo_preset, tiny_overrides, tmp_path,
                                                  subprocess_env):
    runs = tmp_path / "runs"
    env = subprocess_env(PREFECT_API_URL=prefect_server)
    proc = subprocess.Popen([sys.executable, "-m", "rlhf_cli.main", "run", "-c", demo_preset, "--run-name", NAME,
                             "--iterations", "50", *tiny_overrides(runs, "trainer.logger=[console]")],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(runs / NAME / "iter_1", proc, timeout=300)  # iteration 1 has begun
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    [killed] = _flow_runs(f"run-{NAME}")
    assert killed.state.type == StateType.RUNNING  # nobody told Prefect: Running for good, until the resume

    done = rlhf_pipeline(PipelineParams(resume=str(runs / NAME), iterations=1))
    assert done["last_good"]["iteration"] == 1

    [after] = _flow_runs(f"run-{NAME}")
    assert after.state.type == StateType.CRASHED, after.state
    assert f"resume-{NAME}" in after.state.message and str(runs / NAME) in after.state.message
    [resumed] = _flow_runs(f"resume-{NAME}")
    assert resumed.state.type == StateType.COMPLETED  # the resume itself finished normally
