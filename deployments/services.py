"""Local services for the deployments, on 127.0.0.1 only: a Prefect server (UI + API), the process
work pool and its worker, and an MLflow UI over the project's tracking store.

    python -m deployments.services up [--prefect-port 4200] [--mlflow-port 5000] [--concurrency 1]
    python -m deployments.services status
    python -m deployments.services register      # re-register deployments/prefect.yaml
    python -m deployments.services down          # stop everything `up` started, by PID

`up` starts the server, creates the work pool ``rlhf-local`` (type process) with a concurrency limit
(default 1: scheduled and manual runs queue instead of training at once on one machine), registers
the deployments of deployments/prefect.yaml, starts a worker for the pool and the MLflow UI, then
prints the addresses. PIDs, ports and logs live under ``<state dir>/services/`` ($RLHF_HOME or
./.rlhf); Prefect's database under ``$PREFECT_HOME`` (default ``<state dir>/prefect``). Flow runs
start in the project root, write run directories under trainer.runs_root and track into
``<state dir>/mlflow/mlflow.db``, the store the MLflow UI shows.

`down` stops the worker (SIGTERM twice: its first one only starts a graceful shutdown), the MLflow UI
and the server, waits for each process tree to exit, SIGKILLs what is left after a timeout, and
removes the state file. A run being trained when `down` is called is stopped with its worker;
continue it later with ``rlhf run --resume RUN_DIR``.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional, Sequence

from deployments.service_state import (
    Service, ServiceError, State, http_ok, prefect_home, process_of, read_state, services_dir, state_path,
)
from rlhf_core.errors import RLHFError
from rlhf_core.io.atomic import atomic_write_json
from rlhf_core.paths import project_root, state_dir
from rlhf_core.security import redact_text
from tasks.mlflow_tracking import TRAINING_VIEW
from tasks.prefect_runs import mark_crashed, unfinished

HOST = "127.0.0.1"
PREFECT_FILE = Path("deployments") / "prefect.yaml"
QUIET_ENV = {
    "DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true",
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
    # `mlflow server` otherwise starts ~7 job-runner processes (~2 GB) this project never uses
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
}
STOP_ORDER = ("worker", "mlflow", "prefect")
"""Worker first (no new flow runs), the server last (the worker reports to it while stopping)."""


# ---------------------------------------------------------------------------------------------
# environment, state file (read in deployments.service_state)
# ---------------------------------------------------------------------------------------------


def service_env(api_url: Optional[str] = None) -> dict[str, str]:
    """The environment every service and flow run gets: the caller's, the quiet offline defaults
    (the caller's explicit values win), absolute RLHF_HOME / PREFECT_HOME so the worker's flow runs
    use the same state directory as this command, and the server's API address."""
    env = {**QUIET_ENV, **os.environ}
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
    env["RLHF_HOME"] = str(state_dir())
    env["PREFECT_HOME"] = str(prefect_home())
    if api_url:
        env["PREFECT_API_URL"] = api_url
    else:
        env.pop("PREFECT_API_URL", None)
    return env


def write_state(state: State) -> None:
    atomic_write_json(state_path(), {**asdict(state), "services": {k: asdict(v) for k, v in state.services.items()}})


def read_pool_name(prefect_file: Path | None = None) -> str:
    """The work pool the deployments name (one source of truth: deployments/prefect.yaml)."""
    import yaml

    path = prefect_file or project_root() / PREFECT_FILE
    spec = yaml.safe_load(path.read_text())
    pools = {d.get("work_pool", {}).get("name") for d in spec.get("deployments", [])}
    if len(pools) != 1 or None in pools:
        raise ServiceError(f"{path}: every deployment must name the same work pool (found {sorted(map(str, pools))})")
    return pools.pop()


def deployment_names(prefect_file: Path | None = None) -> list[str]:
    import yaml

    path = prefect_file or project_root() / PREFECT_FILE
    return [d["name"] for d in yaml.safe_load(path.read_text()).get("deployments", [])]


# ---------------------------------------------------------------------------------------------
# processes
# ---------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def check_port(port: int, flag: str) -> int:
    """``port`` when nothing listens on it (0: pick a free one), else ServiceError naming the flag."""
    if port == 0:
        return free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            raise ServiceError(f"port {port} on {HOST} is in use (another server? `python -m deployments.services "
                               f"status` shows ours); pick another with {flag} PORT, or {flag} 0 for any free port") \
                from None
    return port


def spawn(name: str, cmd: Sequence[str], env: dict[str, str]) -> Service:
    """Start ``cmd`` detached (own session, so a Ctrl-C in this terminal does not reach it), output
    appended to <state dir>/services/logs/<name>.log."""
    import psutil

    log = services_dir() / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
        out.flush()
        proc = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=project_root(), env=env, start_new_session=True)
    return Service(name=name, pid=proc.pid, create_time=psutil.Process(proc.pid).create_time(), log=str(log))


def log_tail(svc: Service, lines: int = 25) -> str:
    try:
        return "\n".join(Path(svc.log).read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def wait_until(check: Callable[[], bool], svc: Service, what: str, timeout: float) -> None:
    """Poll ``check`` until true; fail early (with the log's tail) when the process died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        if process_of(svc) is None:
            raise ServiceError(f"{svc.name} exited before {what}; last lines of {svc.log}:\n{log_tail(svc)}")
        time.sleep(0.5)
    raise ServiceError(f"{svc.name} not {what} after {timeout:.0f} s; last lines of {svc.log}:\n{log_tail(svc)}")


def api_call(method: str, url: str, attempts: int = 8, **kwargs):
    """One Prefect REST call, retried like Prefect's own client does on 503 (the server's answer to
    SQLITE_BUSY_SNAPSHOT, which SQLite's busy timeout does not cover) and on dropped connections."""
    import httpx

    timeout = kwargs.pop("timeout", 30)
    for attempt in range(attempts):
        try:
            resp = httpx.request(method, url, timeout=timeout, **kwargs)
            if resp.status_code != 503 or attempt == attempts - 1:
                return resp
        except httpx.TransportError:
            if attempt == attempts - 1:
                raise
        time.sleep(min(0.5 * 2 ** attempt, 8.0))
    raise AssertionError("unreachable")


def stop_service(svc: Service, timeout: float = 30.0) -> list[int]:
    """Stop a service and every process under it (flow runs of the worker included); returns the
    PIDs that had to be killed. The worker gets two SIGTERMs: its first one only starts a graceful
    shutdown that waits for its flow runs."""
    import psutil

    proc = process_of(svc)
    if proc is None:
        return []
    try:
        tree = [proc] + proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    proc.send_signal(signal.SIGTERM)
    if svc.name == "worker":
        _, alive = psutil.wait_procs([proc], timeout=3)
        if alive:
            proc.send_signal(signal.SIGTERM)
    psutil.wait_procs([proc], timeout=timeout)
    for p in tree:  # whatever the parent left behind (or the parent itself, if it ignored us)
        if p.is_running():
            _signal_quietly(p, signal.SIGTERM)
    _, alive = psutil.wait_procs(tree, timeout=timeout / 2)
    for p in alive:
        _signal_quietly(p, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=5)
    return [p.pid for p in alive]


def _signal_quietly(proc, sig: int) -> None:
    import psutil

    try:
        proc.send_signal(sig)
    except psutil.NoSuchProcess:
        pass


# ---------------------------------------------------------------------------------------------
# Prefect: server, work pool, deployments, worker
# ---------------------------------------------------------------------------------------------


def prefect_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "prefect", *args]


def start_prefect_server(port: int, timeout: float) -> Service:
    url = f"http://{HOST}:{port}"
    env = service_env(f"{url}/api")
    env["PREFECT_UI_API_URL"] = f"{url}/api"  # the browser's API address (default: port 4200, whatever --port says)
    svc = spawn("prefect", prefect_cmd("server", "start", "--host", HOST, "--port", str(port)), env)
    svc.url = url
    wait_until(lambda: http_ok(f"{url}/api/health"), svc, f"healthy at {url}/api/health", timeout)
    return svc


def ensure_work_pool(api_url: str, pool: str, concurrency: int) -> None:
    """Create the process work pool (or keep it) and set its concurrency limit."""
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    with SyncPrefectClient(api=api_url) as client:
        try:
            existing = client.read_work_pool(pool)
        except ObjectNotFound:
            existing = None
        if existing is None:
            client.create_work_pool(WorkPoolCreate(
                name=pool, type="process", concurrency_limit=concurrency,
                base_job_template=ProcessWorker.get_default_base_job_template(),
                description="Local process pool of the RLHF deployments (python -m deployments.services)"))
        elif existing.type != "process":
            raise ServiceError(f"work pool {pool!r} exists with type {existing.type!r}; delete it in the Prefect UI "
                               "(Work Pools) or with `prefect work-pool delete`, then run `up` again")
        else:
            client.update_work_pool(pool, WorkPoolUpdate(concurrency_limit=concurrency))


def register_deployments(api_url: str, timeout: float = 600.0) -> dict[str, str]:
    """``prefect --no-prompt deploy --all --prefect-file deployments/prefect.yaml`` from the project
    root, then read the deployments back; returns {deployment name: id}. A prefect.yaml that Prefect
    skips (it only prints a warning) is reported as an error here, and so is a deploy still running
    after ``timeout`` seconds (it imports each flow's module: torch, transformers, DeepSpeed, which
    took over 300 s on a loaded 2-core machine), with the option that raises the limit."""
    cmd = prefect_cmd("--no-prompt", "deploy", "--all", "--prefect-file", str(PREFECT_FILE))
    log = services_dir() / "logs" / "register.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:  # the output lands in the log whether the deploy ends or is stopped
        try:
            returncode = subprocess.run(cmd, cwd=project_root(), env=service_env(api_url), stdout=out,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            raise ServiceError(f"registering {PREFECT_FILE} (`prefect deploy`) did not finish in {timeout:.0f} s and "
                               f"was stopped (its output: {log}); give it longer with --timeout SECONDS") from None
    output = log.read_text(errors="replace")
    found = read_deployments(api_url)
    missing = [name for name in deployment_names() if name not in found]
    if returncode != 0 or missing:
        tail = "\n".join(output.splitlines()[-30:])
        raise ServiceError(f"registering {PREFECT_FILE} failed (exit {returncode}; missing: "
                           f"{', '.join(missing) or 'none'}); output in {log}:\n{tail}")
    return {name: found[name] for name in deployment_names()}


def read_deployments(api_url: str) -> dict[str, str]:
    resp = api_call("POST", f"{api_url}/deployments/filter", json={})
    resp.raise_for_status()
    return {d["name"]: d["id"] for d in resp.json()}


def start_worker(api_url: str, pool: str, timeout: float) -> Service:
    """A process worker for ``pool``; ready once it has sent a heartbeat (the pool's READY status
    alone could come from an earlier worker's heartbeat)."""
    from datetime import datetime

    import httpx

    name = f"{pool}-worker"
    cmd = prefect_cmd("worker", "start", "--pool", pool, "--name", name, "--install-policy", "never",
                      "--no-create-pool-if-not-found")
    svc = spawn("worker", cmd, service_env(api_url))

    def ready() -> bool:
        try:
            resp = api_call("POST", f"{api_url}/work_pools/{pool}/workers/filter", attempts=1, json={}, timeout=5)
        except httpx.HTTPError:
            return False
        beats = [w.get("last_heartbeat_time") for w in resp.json() if w.get("name") == name] \
            if resp.status_code == 200 else []
        return any(b and datetime.fromisoformat(b.replace("Z", "+00:00")).timestamp() >= svc.create_time - 1
                   for b in beats)

    wait_until(ready, svc, f"polling work pool {pool!r}", timeout)
    return svc


# ---------------------------------------------------------------------------------------------
# MLflow UI
# ---------------------------------------------------------------------------------------------


def tracking_store() -> tuple[Optional[str], Optional[str]]:
    """(backend store URI, artifact root) of the project's tracking store, as tasks.mlflow_tracking
    resolves it; (None, None) when MLFLOW_TRACKING_URI names a server (it has its own UI)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri and not uri.startswith("sqlite:"):
        return None, None
    store = state_dir() / "mlflow"
    (store / "artifacts").mkdir(parents=True, exist_ok=True)
    return uri or f"sqlite:///{store / 'mlflow.db'}", (store / "artifacts").as_uri()


def spawn_mlflow_ui(port: int) -> Optional[Service]:
    """Start the MLflow UI (not waited for: it starts while the Prefect side comes up)."""
    store, artifacts = tracking_store()
    if store is None:
        return None
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", HOST, "--port", str(port), "--workers", "1",
           "--backend-store-uri", store, "--default-artifact-root", artifacts]
    svc = spawn("mlflow", cmd, service_env(None))
    svc.url = f"http://{HOST}:{port}"
    return svc


def wait_mlflow_ui(svc: Service, timeout: float) -> None:
    wait_until(lambda: http_ok(f"{svc.url}/health"), svc, f"healthy at {svc.url}/health", timeout)


# ---------------------------------------------------------------------------------------------
# commands
# ---------------------------------------------------------------------------------------------


def up(prefect_port: int = 4200, mlflow_port: int = 5000, concurrency: int = 1, timeout: float = 600.0,
       mlflow: bool = True, say: Callable[[str], None] = print) -> State:
    """Start everything (see the module docstring); on any failure, stop what was started."""
    if concurrency < 1:
        raise ServiceError(f"--concurrency {concurrency}: must be >= 1 (flow runs the pool may run at once)")
    existing = read_state()
    if existing is not None:
        if any(process_of(svc) for svc in existing.services.values()):
            raise ServiceError(f"services are already up (Prefect UI {existing.prefect_url}); "
                               "`python -m deployments.services down` first")
        state_path().unlink()
    prefect_port = check_port(prefect_port, "--prefect-port")
    mlflow_port = check_port(mlflow_port, "--mlflow-port") if mlflow else 0
    state = State(prefect_url=f"http://{HOST}:{prefect_port}", mlflow_url=None, pool=read_pool_name(),
                  concurrency=concurrency, rlhf_home=str(state_dir()), prefect_home=str(prefect_home()))
    try:
        _start_all(state, mlflow_port if mlflow else None, timeout, say)
    except BaseException:
        down(quiet=True, state=state)
        raise
    return state


def _start_all(state: State, mlflow_port: Optional[int], timeout: float, say: Callable[[str], None]) -> None:
    started = time.monotonic()

    def done(what: str) -> None:
        say(f"[{time.monotonic() - started:5.1f} s] {what}")

    mlflow_svc = spawn_mlflow_ui(mlflow_port) if mlflow_port is not None else None
    if mlflow_svc is not None:
        state.services["mlflow"] = mlflow_svc
    state.services["prefect"] = start_prefect_server(int(state.prefect_url.rsplit(":", 1)[1]), timeout)
    write_state(state)
    done(f"Prefect server healthy at {state.prefect_url}")
    ensure_work_pool(state.api_url, state.pool, state.concurrency)
    done(f"work pool {state.pool!r} (process, concurrency limit {state.concurrency})")
    names = register_deployments(state.api_url, timeout)
    done(f"deployments registered: {', '.join(names)}")
    state.services["worker"] = start_worker(state.api_url, state.pool, timeout)
    write_state(state)
    done(f"worker polling {state.pool!r}")
    if mlflow_svc is not None:
        wait_mlflow_ui(mlflow_svc, timeout)
        state.mlflow_url = mlflow_svc.url
        done(f"MLflow UI healthy at {mlflow_svc.url}")
    write_state(state)


def down(quiet: bool = False, state: Optional[State] = None, timeout: float = 30.0) -> list[str]:
    """Stop every recorded service (worker, MLflow UI, server); returns lines describing what happened."""
    state = state or read_state()
    lines = []
    if state is None:
        lines.append(f"nothing to stop (no {state_path()})")
    else:
        for name in STOP_ORDER:
            svc = state.services.get(name)
            if svc is None:
                continue
            running = process_of(svc) is not None
            killed = stop_service(svc, timeout) if running else []
            note = f" (SIGKILLed {killed})" if killed else ""
            lines.append(f"{name:8s} pid {svc.pid}: {'stopped' + note if running else 'was not running'}")
            if name == "worker" and running and process_of(state.services["prefect"]) is not None:
                lines += [f"         flow run {r} marked Crashed (resume its run directory with "
                          "`rlhf run --resume RUN_DIR`)" for r in mark_interrupted_runs(state.api_url, state.pool)]
        (Path(state.rlhf_home) / "services" / state_path().name).unlink(missing_ok=True)
    if not quiet:
        print("\n".join(lines))
    return lines


def mark_interrupted_runs(api_url: str, pool: str) -> list[str]:
    """Flow runs of ``pool`` still Pending/Running after their worker stopped: set them Crashed, so the
    UI does not show them running forever. Returns their names."""
    import httpx
    from prefect.client.orchestration import SyncPrefectClient

    try:
        with SyncPrefectClient(api=api_url) as client:  # Prefect's client retries a busy server's 503
            runs = mark_crashed(client, unfinished(pool=pool),
                                "stopped by `python -m deployments.services down` while running")
    except httpx.HTTPError:
        return []
    return [run.name for run in runs]


def status_lines(state: Optional[State] = None) -> list[str]:
    state = state or read_state()
    if state is None:
        return [f"not running (no {state_path()}); start with `python -m deployments.services up`"]
    lines = []
    for name in ("prefect", "worker", "mlflow"):
        svc = state.services.get(name)
        if svc is None:
            continue
        alive = process_of(svc) is not None
        where = f"  {svc.url}" if svc.url else ""
        lines.append(f"{name:8s} pid {svc.pid:<7d} {'running' if alive else 'NOT RUNNING'}{where}  log {svc.log}")
    lines.append(f"work pool {state.pool!r}, concurrency limit {state.concurrency}; RLHF_HOME={state.rlhf_home}")
    return lines


def url_lines(state: State) -> list[str]:
    lines = [f"Prefect UI     {state.prefect_url}/deployments   (rlhf-train: Run; rlhf-retrain: weekly schedule)",
             f"Prefect API    {state.api_url}"]
    tracking = os.environ.get("MLFLOW_TRACKING_URI")
    if state.mlflow_url:
        lines.append(f"MLflow UI      {state.mlflow_url}/#/experiments?{TRAINING_VIEW}   (experiment = "
                     "trainer.experiment_name, e.g. 'demo')")
    elif tracking and not tracking.startswith("sqlite:"):
        lines.append(f"MLflow         MLFLOW_TRACKING_URI={redact_text(tracking)} (its own UI)")
    else:
        lines.append("MLflow UI      not started (--no-mlflow)")
    lines.append(f"stop with      python -m deployments.services down     (logs: {services_dir() / 'logs'})")
    return lines


TIMEOUT_HELP = ("seconds to wait for each service to be ready, and for `prefect deploy` to register the "
                "deployments (default 600: on a loaded 2-core machine the deploy took over 300 s)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m deployments.services",
                                     description="Local Prefect server + worker + MLflow UI on 127.0.0.1.")
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("up", help="start the server, pool, deployments, worker and MLflow UI")
    start.add_argument("--prefect-port", type=int, default=4200, help="Prefect UI/API port (0 = any free port)")
    start.add_argument("--mlflow-port", type=int, default=5000, help="MLflow UI port (0 = any free port)")
    start.add_argument("--concurrency", type=int, default=1,
                       help="flow runs the work pool may run at once (default 1: one training per machine)")
    start.add_argument("--no-mlflow", action="store_true", help="do not start the MLflow UI")
    start.add_argument("--timeout", type=float, default=600.0, help=TIMEOUT_HELP)
    sub.add_parser("down", help="stop everything `up` started (by PID)")
    sub.add_parser("status", help="PIDs, addresses and whether each service runs")
    register = sub.add_parser("register", help="(re)register deployments/prefect.yaml on the running server")
    register.add_argument("--timeout", type=float, default=600.0, help=TIMEOUT_HELP)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "up":
            state = up(args.prefect_port, args.mlflow_port, args.concurrency, args.timeout, not args.no_mlflow)
            print("\n".join(status_lines(state) + [""] + url_lines(state)))
        elif args.command == "down":
            down()
        elif args.command == "status":
            print("\n".join(status_lines()))
        else:
            state = read_state()
            if state is None or process_of(state.services["prefect"]) is None:
                raise ServiceError("the Prefect server is not running; `python -m deployments.services up` first")
            for name, dep_id in register_deployments(state.api_url, args.timeout).items():
                print(f"registered {name}: {state.prefect_url}/deployments/deployment/{dep_id}")
    except RLHFError as exc:
        print(f"services: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
