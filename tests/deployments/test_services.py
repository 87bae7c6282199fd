"""The service manager's process handling on real (small) processes: ports, the state file, and
stopping whole process trees by PID, SIGKILL only for what ignores SIGTERM."""

from __future__ import annotations

import socket
import sys
import textwrap
import time

import psutil
import pytest

from deployments import services
from deployments.services import Service, ServiceError, State

# a parent that starts a child; each ignores SIGTERM `ignore` times before exiting on the next one
TREE = textwrap.dedent("""
    import signal, subprocess, sys, time
    ignore = int(sys.argv[1]); child_ignore = sys.argv[2]
    seen = []
    def on_term(*_):
        seen.append(1)
        if len(seen) > ignore:
            sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    if child_ignore != "-":
        subprocess.Popen([sys.executable, __file__, child_ignore, "-"])
    while True:
        time.sleep(0.05)
""")


@pytest.fixture
def tree_script(tmp_path):
    path = tmp_path / "tree.py"
    path.write_text(TREE)
    return path


def _start(name: str, script, ignore: int, child_ignore: str) -> tuple[Service, list[int]]:
    svc = services.spawn(name, [sys.executable, str(script), str(ignore), child_ignore], services.service_env())
    proc = psutil.Process(svc.pid)
    deadline = time.monotonic() + 60
    while child_ignore != "-" and not proc.children() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)  # let both install their SIGTERM handlers
    return svc, [svc.pid] + [c.pid for c in proc.children(recursive=True)]


def _gone(pids: list[int]) -> bool:
    return not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


def test_stop_service_stops_the_whole_tree_and_kills_only_what_ignores_sigterm(tree_script):
    svc, pids = _start("mlflow", tree_script, ignore=0, child_ignore="0")
    assert len(pids) == 2
    assert services.stop_service(svc, timeout=10) == [] and _gone(pids)

    svc, pids = _start("mlflow", tree_script, ignore=0, child_ignore="99")  # a child that ignores SIGTERM
    killed = services.stop_service(svc, timeout=4)
    assert killed == pids[1:] and _gone(pids)


def test_worker_gets_a_second_sigterm(tree_script):
    svc, pids = _start("worker", tree_script, ignore=1, child_ignore="-")
    assert services.stop_service(svc, timeout=10) == [] and _gone(pids)


def test_a_recycled_pid_is_not_ours(tree_script):
    svc, pids = _start("mlflow", tree_script, ignore=0, child_ignore="-")
    stranger = Service(name="mlflow", pid=svc.pid, create_time=svc.create_time - 1000, log=svc.log)
    assert services.process_of(stranger) is None and services.stop_service(stranger) == []
    assert services.process_of(svc) is not None
    services.stop_service(svc, timeout=10)
    assert _gone(pids)


def test_busy_port_names_the_flag():
    with socket.socket() as s:
        s.bind((services.HOST, 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ServiceError, match=f"port {port} .* in use.*--prefect-port"):
            services.check_port(port, "--prefect-port")
    assert services.check_port(0, "--mlflow-port") > 0


def test_state_file_round_trip_and_down_without_services(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RLHF_HOME", str(tmp_path / "home"))
    assert services.down() == [f"nothing to stop (no {services.state_path()})"]
    state = State(prefect_url="http://127.0.0.1:1", mlflow_url=None, pool="rlhf-local", concurrency=1,
                  rlhf_home=str(tmp_path / "home"), prefect_home=str(tmp_path / "ph"),
                  services={"worker": Service(name="worker", pid=2 ** 22 + 7, create_time=0.0, log="w.log")})
    services.write_state(state)
    assert services.read_state() == state
    assert "NOT RUNNING" in services.status_lines()[0]
    assert services.main(["down"]) == 0 and not services.state_path().exists()
    assert services.read_pool_name() == "rlhf-local"
    assert services.deployment_names() == ["rlhf-train", "rlhf-retrain"]


def test_up_refuses_bad_concurrency():
    with pytest.raises(ServiceError, match="--concurrency 0: must be >= 1"):
        services.up(concurrency=0)


def test_a_deploy_slower_than_timeout_is_one_line_naming_the_option(tmp_path, monkeypatch):
    """Issue 43: `prefect deploy` past its limit ended `make services-up` in a traceback
    (subprocess.TimeoutExpired), and the limit was a fixed 300 s whatever `--timeout` said. Through
    the real command against a real server: `register --timeout 1` stops the deploy (which alone
    takes seconds to import Prefect) and says so in one line."""
    import subprocess

    monkeypatch.setenv("RLHF_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("PREFECT_HOME", raising=False)
    server = services.start_prefect_server(services.free_port(), timeout=180)
    try:
        services.write_state(State(prefect_url=server.url, mlflow_url=None, pool="rlhf-local", concurrency=1,
                                   rlhf_home=str(tmp_path / "home"), prefect_home=str(services.prefect_home()),
                                   services={"prefect": server}))
        out = subprocess.run([sys.executable, "-m", "deployments.services", "register", "--timeout", "1"],
                             capture_output=True, text=True, timeout=120, cwd=services.project_root(),
                             env=services.service_env(server.url + "/api"))
    finally:
        services.stop_service(server, timeout=20)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith("services: error: registering deployments/prefect.yaml (`prefect deploy`) did not "
                               "finish in 1 s") and lines[0].endswith("give it longer with --timeout SECONDS"), lines
    assert (tmp_path / "home" / "services" / "logs" / "register.log").is_file()
