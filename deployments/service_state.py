"""What `python -m deployments.services up` recorded: the services' PIDs, addresses and logs in
``<state dir>/services/services.json``, whether each still runs, and whether its Prefect server
answers.

Kept apart from ``deployments.services`` (which loads Prefect): every `rlhf` command that runs a
flow asks ``running_prefect_api`` before Prefect is imported, to report to the services' server
when it is up instead of starting a temporary one.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from rlhf_core.errors import RLHFError
from rlhf_core.paths import state_dir


class ServiceError(RLHFError):
    """A service did not start, or the state file does not match what is running."""


@dataclass
class Service:
    name: str
    pid: int
    create_time: float
    """psutil's process start time: a recycled PID is never mistaken for ours."""
    log: str
    url: Optional[str] = None


@dataclass
class State:
    prefect_url: str
    mlflow_url: Optional[str]
    pool: str
    concurrency: int
    rlhf_home: str
    prefect_home: str
    services: dict[str, Service] = field(default_factory=dict)

    @property
    def api_url(self) -> str:
        return f"{self.prefect_url}/api"


def services_dir() -> Path:
    return state_dir() / "services"


def state_path() -> Path:
    return services_dir() / "services.json"


def prefect_home() -> Path:
    return Path(os.environ.get("PREFECT_HOME") or state_dir() / "prefect").expanduser().resolve()


def read_state() -> Optional[State]:
    try:
        raw = json.loads(state_path().read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as exc:
        raise ServiceError(f"{state_path()} is not valid JSON ({exc}); stop the processes it named by hand "
                           "and delete it") from None
    services = {name: Service(**svc) for name, svc in raw.pop("services", {}).items()}
    return State(**raw, services=services)


def process_of(svc: Service):
    """The live psutil.Process of a recorded service, or None (exited, or the PID was reused)."""
    import psutil

    try:
        proc = psutil.Process(svc.pid)
        if abs(proc.create_time() - svc.create_time) > 1.0 or proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except psutil.NoSuchProcess:
        return None


def http_ok(url: str, timeout: float = 5.0) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def running_prefect_api(timeout: float = 2.0) -> Optional[str]:
    """The API URL of the Prefect server `up` started, when its process runs and answers
    ``/api/health`` within ``timeout``; None otherwise (never started, stopped, a stale state file
    after a reboot, a damaged one)."""
    try:
        state = read_state()
    except ServiceError:
        return None  # `services status` / `down` say what is wrong with it; a command just does without
    server = state.services.get("prefect") if state else None
    if server is None or process_of(server) is None:
        return None
    return state.api_url if http_ok(f"{state.api_url}/health", timeout) else None
