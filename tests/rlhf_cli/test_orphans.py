"""`kill -9` of `rlhf run` leaves nothing behind: the temporary Prefect server it started (and any
other process under it) is gone within seconds, and its port is free again."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.prefect, pytest.mark.slow]

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
GONE_WITHIN_S = 15.0


def _rlhf() -> str:
    return shutil.which("rlhf", path=str(Path(sys.executable).parent)) or "rlhf"


def _listening_port(proc: psutil.Process) -> int | None:
    try:
        return next((c.laddr.port for c in proc.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN), None)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def _server_of(cli: subprocess.Popen, timeout: float) -> tuple[psutil.Process, int]:
    """The process under the CLI that listens on a TCP port (the temporary Prefect server)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cli.poll() is not None:
            pytest.fail(f"rlhf run ended (rc {cli.returncode}) before its Prefect server listened:\n"
                        f"{cli.stderr.read()[-3000:]}")
        for child in psutil.Process(cli.pid).children(recursive=True):
            port = _listening_port(child)
            if port is not None:
                return child, port
        time.sleep(0.2)
    pytest.fail(f"no process under rlhf run listened on a port within {timeout:.0f} s")


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_kill_9_of_rlhf_run_takes_its_prefect_server_with_it(tmp_path, tiny_model_dir):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}  # its own temporary server
    env["RLHF_HOME"] = os.environ["RLHF_HOME"]  # the test's home, where 'tiny' resolves
    # the smallest run the CLI tests use; many iterations, so the run is surely still going when killed
    args = [_rlhf(), "run", "-c", str(DEMO), "--run-name", "orphans", "--iterations", "50",
            f"trainer.runs_root={tmp_path / 'runs'}", f"actor_rollout_ref.model.path={tiny_model_dir}",
            "actor_rollout_ref.model.warm_start.enable=false", "data.train_batch_size=4", "data.max_val_samples=4",
            "data.max_response_length=12", "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.device=cpu"]
    cli = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                           env=env, start_new_session=True)
    survivors: list[psutil.Process] = []
    try:
        server, port = _server_of(cli, timeout=180)
        assert _port_open(port)
        tree = psutil.Process(cli.pid).children(recursive=True)
        cli.send_signal(signal.SIGKILL)
        cli.wait()
        killed_at = time.monotonic()
        while time.monotonic() - killed_at < GONE_WITHIN_S:
            survivors = [p for p in tree if _alive(p)]
            if not survivors and not _port_open(port):
                break
            time.sleep(0.25)
        seconds = time.monotonic() - killed_at
        print(f"\n[timing] {seconds:.1f} s after kill -9: {len(survivors)} of the {len(tree)} processes under "
              f"rlhf run alive (server pid {server.pid}), port {port} {'open' if _port_open(port) else 'closed'}")
        assert not survivors, f"still alive {GONE_WITHIN_S:.0f} s after kill -9 of rlhf run: " + \
            ", ".join(f"{p.pid} {' '.join(p.cmdline()[:4])}" for p in survivors)
        assert not _port_open(port), f"port {port} still listening {GONE_WITHIN_S:.0f} s after kill -9"
    finally:
        for p in psutil.Process().children(recursive=True) + survivors:  # never leave a server behind
            if _alive(p):
                p.kill()
        try:
            os.killpg(cli.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
