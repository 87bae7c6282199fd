"""The Prefect server a command reports to, through the real `rlhf` console script (issue 18):

- with the local services up (their state file naming a live, healthy server: the session's test
  server here), a command reports to that server, says so in one line and starts no temporary one;
- a temporary server killed mid-run (kill -9 of the server process only) stops the run within
  seconds: one line with the resume command, exit 75, no traceback, no ERROR lines, and the run is
  left resumable.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import psutil
import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowFilter, FlowFilterName

from deployments.service_state import Service, State, running_prefect_api
from deployments.services import write_state
from rlhf_cli import session
from rlhf_cli.main import main
from rlhf_cli.orchestrated import EXIT_SERVER_GONE
from rlhf_core.run.layout import RunDir
from rlhf_core.run.lock import RunLock
from rlhf_core.control.plan import plan_run

pytestmark = [pytest.mark.prefect, pytest.mark.slow]

STOPPED_WITHIN_S = 40.0
"""Kill of the server → `rlhf run` has exited: it notices at once, then gives its exit hooks up to
10 s (rlhf_cli.main.EXIT_GRACE_SECONDS); the rest is slack for a loaded machine."""


def _rlhf() -> str:
    return shutil.which("rlhf", path=str(Path(sys.executable).parent)) or "rlhf"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}  # no server configured
    return {**env, **extra}


def _listening_child(parent: psutil.Process, port: int | None = None) -> psutil.Process | None:
    """The process under ``parent`` that listens on ``port`` (on any port: None)."""
    for child in parent.children(recursive=True):
        try:
            ports = [c.laddr.port for c in child.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if ports and (port is None or port in ports):
            return child
    return None


def _services_up_at(api_url: str) -> None:
    """A services state file (as `python -m deployments.services up` writes it) naming the server
    at ``api_url``, in this test's RLHF_HOME."""
    server = _listening_child(psutil.Process(), urlparse(api_url).port)
    home = os.environ["RLHF_HOME"]
    write_state(State(prefect_url=api_url.removesuffix("/api"), mlflow_url=None, pool="rlhf-local", concurrency=1,
                      rlhf_home=home, prefect_home=str(Path(home) / "prefect"),
                      services={"prefect": Service(name="prefect", pid=server.pid, create_time=server.create_time(),
                                                   log=str(Path(home) / "prefect.log"))}))


def _stage_runs_of(run_dir: Path) -> list:
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["rlhf-stage"])))
    return [r for r in runs if (r.parameters.get("params") or {}).get("run_dir") == str(run_dir)]


def test_a_command_reports_to_the_services_server_when_it_is_up(prefect_server, demo_preset, tiny_model_dir,
                                                                      tmp_path):
    assert running_prefect_api() is None  # no state file: a temporary server would be used
    _services_up_at(prefect_server)
    assert running_prefect_api() == prefect_server
    run_dir = tmp_path / "runs" / "svc"
    out = subprocess.run([_rlhf(), "stage", "warm_start", "--run-dir", str(run_dir), "-c", demo_preset,
                          f"actor_rollout_ref.model.path={tiny_model_dir}",
                          "actor_rollout_ref.model.warm_start.enable=false", f"trainer.runs_root={tmp_path / 'runs'}"],
                         capture_output=True, text=True, cwd=tmp_path, env=_env(), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    said = [line for line in out.stderr.splitlines() if "Prefect server" in line]
    assert said == [f"rlhf: reporting to the local services' Prefect server, {prefect_server.removesuffix('/api')}"], \
        out.stderr[-3000:]
    assert len(_stage_runs_of(run_dir)) == 1  # the flow run is on the services' server
    assert not (Path(os.environ["RLHF_HOME"]) / "prefect" / "temporary-server.log").exists()  # none was started


def test_an_in_process_command_leaves_no_watch_behind(prefect_server, demo_preset, tiny_model_dir, tmp_path):
    """A caller that goes on after `main` (this test session) keeps no watch on the server: one left
    polling would take the session's server stopping at its end for a death mid-command."""
    assert main(["stage", "warm_start", "--run-dir", str(tmp_path / "runs" / "w"), "-c", demo_preset,
                 f"actor_rollout_ref.model.path={tiny_model_dir}", "actor_rollout_ref.model.warm_start.enable=false",
                 f"trainer.runs_root={tmp_path / 'runs'}"]) == 0
    watches = [t for t in threading.enumerate() if t.name == "prefect-server-watch"]
    for thread in watches:
        thread.join(2)  # a closed watch ends within its poll interval
    assert not any(t.is_alive() for t in watches) and session.WATCH is None and session.REPORTING is None


def test_a_killed_temporary_server_stops_the_run_resumable(demo_preset, tiny_overrides, tmp_path):
    runs = tmp_path / "runs"
    run = RunDir(runs / "gone")
    cli = subprocess.Popen([_rlhf(), "run", "-c", demo_preset, *tiny_overrides(runs), "--iterations", "50",
                            "--run-name", "gone"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           cwd=tmp_path, env=_env(), start_new_session=True)
    try:
        server = _server_once_training(cli, run, timeout=240)
        server.kill()  # the server only: rlhf itself is not signalled
        killed_at = time.monotonic()
        out, err = cli.communicate(timeout=STOPPED_WITHIN_S)
        print(f"\n[timing] rlhf run exited {time.monotonic() - killed_at:.1f} s after its server was killed")
    finally:
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
    assert cli.returncode == EXIT_SERVER_GONE, err[-3000:]
    said = [line for line in err.splitlines() if "rlhf: stopped" in line]  # \r too: a progress bar may precede it
    assert len(said) == 1 and said[0].endswith(f"continue with: rlhf run --resume {run.root} "
                                               "(it starts a new temporary server)"), err[-3000:]
    assert "the Prefect server at http://127.0.0.1:" in said[0] and "killed by signal 9" in said[0]
    assert "Traceback" not in out + err and "ERROR" not in out + err, (out + err)[-3000:]
    with RunLock(run):  # no writer left behind
        plan = plan_run(resume=run.root)
    assert plan.resumed and plan.first_iteration >= 1


def _server_once_training(cli: subprocess.Popen, run: RunDir, timeout: float) -> psutil.Process:
    """The temporary server under ``cli`` (the child listening on a port), once iteration 1 runs."""
    deadline = time.monotonic() + timeout
    while not (run.root / "iter_1").exists():
        if cli.poll() is not None:
            pytest.fail(f"rlhf run ended (rc {cli.returncode}) before training:\n{cli.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"iteration 1 did not start within {timeout:.0f} s")
        time.sleep(0.2)
    server = _listening_child(psutil.Process(cli.pid))
    assert server is not None, "no process under rlhf run listens on a port"
    return server
