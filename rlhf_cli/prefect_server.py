"""The Prefect server a command that runs flows reports to, and the watch that notices when it dies.

Which server, first match: the one Prefect's own settings name (PREFECT_API_URL, a Prefect
profile); the local services' server (`make services-up`) when its process runs and it answers;
else a temporary server that belongs to this command.

The temporary server costs little because most of its start overlaps the command's own imports:
`rlhf_cli.main` starts its process first thing (``prewarm``: this module imports no Prefect), and
that process imports Prefect's server and migrates the database while `rlhf` imports torch and the
flows, then waits. Only once the command has checked its arguments does ``TemporaryServer.start``
let it listen, so a refused argument never starts a server. The process has a session of its own
(a terminal's Ctrl-C reaches only `rlhf`, which can then still report the interruption to it); it
stops itself as soon as `rlhf` is gone however it went (kill -9 included), and `rlhf` stops it at
exit, after Prefect has delivered its last events.

``ServerWatch`` notices a server that dies mid-command (its process exited, or nothing listens at
its address any more) and calls back once: the command stops in seconds instead of Prefect's
clients retrying a dead server for many minutes (issue 18).
"""

from __future__ import annotations

import atexit
import os
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from deployments.service_state import http_ok, running_prefect_api
from rlhf_core.errors import RLHFError

HOST = "127.0.0.1"
"""The temporary server listens on loopback only (tests/reliability/test_security.py)."""
LOG_NAME = "temporary-server.log"
"""The temporary server's output, under PREFECT_HOME (created only when a server starts)."""

_SERVER = r'''
import os, signal, sys, threading, time

RLHF = int(sys.argv[1])
migrating = threading.Event()


def leave_with_rlhf():
    # rlhf is gone however it went (kill -9 included): this process was reparented
    while os.getppid() == RLHF:
        time.sleep(0.25)
    for _ in range(240):  # SQLite DDL is not all transactional: let a migration finish first
        if not migrating.is_set():
            break
        time.sleep(0.25)
    os.kill(os.getpid(), signal.SIGTERM)  # uvicorn stops gracefully; before it serves, this ends the process
    time.sleep(5)
    os._exit(1)


threading.Thread(target=leave_with_rlhf, daemon=True).start()

import asyncio, socket  # noqa: E402
import uvicorn  # noqa: E402
from prefect.server.api.server import create_app  # noqa: E402  the slow part, while rlhf imports its flows
from prefect.server.database import provide_database_interface  # noqa: E402


async def migrate():
    db = provide_database_interface()
    await db.create_db()
    await (await db.engine()).dispose()


app = create_app()
migrating.set()
try:
    asyncio.run(migrate())  # a new database's migrations (~5 s) happen here too, not after the go
except Exception as exc:  # the server's own start migrates again and reports what is wrong
    print(f"migrating ahead of the start failed: {exc!r}", file=sys.stderr, flush=True)
migrating.clear()
log = sys.stdin.readline().strip()
if not log:
    sys.exit(0)  # rlhf needs no server after all: it refused an argument, or it is gone
sock = socket.socket()
sock.bind((sys.argv[2], 0))
print(sock.getsockname()[1], flush=True)
out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
os.dup2(out, 1)
os.dup2(out, 2)
uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="on")).run(sockets=[sock])
'''
"""The temporary server's process: argv = the `rlhf` PID, the host to listen on; stdin: the log
path once it may listen (EOF: it is not needed); stdout: the port it listens on."""

SERVER_ENV = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
"""As Prefect's own temporary server: no UI, only the services a temporary server needs."""


class ServerStartError(RLHFError):
    """The server to report to does not answer, or the temporary one did not come up."""


class TemporaryServer:
    """A Prefect server process of this command's own (see the module docstring)."""

    def __init__(self, home: Path):
        env = {**os.environ, **SERVER_ENV}
        env.pop("PREFECT_API_URL", None)
        self.log = home / LOG_NAME
        self.api_url: Optional[str] = None
        self.stopping = False
        """Set once `rlhf` stops it: from then on its exit is no news (``ServerWatch``)."""
        self.process = subprocess.Popen(
            [sys.executable, "-c", _SERVER, str(os.getpid()), HOST], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)

    def start(self, timeout: float) -> str:
        """Let the process listen and wait until its API answers; returns the API URL. Stopped at
        this process's exit (after Prefect's own exit hooks delivered the last events)."""
        deadline = time.monotonic() + timeout
        self.log.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.process.stdin.write(f"{self.log}\n".encode())
            self.process.stdin.flush()
        except BrokenPipeError:
            pass  # it died while waiting: _port says so
        atexit.register(self.stop)
        self.api_url = f"http://{HOST}:{self._port(deadline)}/api"
        while not http_ok(f"{self.api_url}/health", timeout=max(deadline - time.monotonic(), 0.1)):
            self._fail_if_gone()
            if time.monotonic() > deadline:
                raise ServerStartError(f"the temporary Prefect server did not answer within {timeout:.0f} s "
                                       f"(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS); its log: {self.log}")
            time.sleep(0.1)
        return self.api_url

    def _port(self, deadline: float) -> int:
        ready, _, _ = select.select([self.process.stdout], [], [], max(deadline - time.monotonic(), 0))
        line = self.process.stdout.readline() if ready else b""
        if not line.strip().isdigit():
            self._fail_if_gone()
            raise ServerStartError("the temporary Prefect server did not start listening in time "
                                   "(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS)")
        return int(line)

    def _fail_if_gone(self) -> None:
        reason = self.exit_reason()
        if reason is not None:
            early = self.process.stderr.read().decode(errors="replace").strip().splitlines()[-5:]
            raise ServerStartError(f"the temporary Prefect server {reason} before it answered; "
                                   f"see {self.log}" + (f" ({' / '.join(early)})" if early else ""))

    def exit_reason(self) -> Optional[str]:
        """None while the process runs, else how it ended."""
        code = self.process.poll()
        if code is None:
            return None
        return f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"

    def discard(self) -> None:
        """A pre-started process that will not be needed leaves at once (before it listens)."""
        if self.process.stdin and not self.process.stdin.closed:
            self.process.stdin.close()

    def stop(self) -> None:
        """Stop the server (SIGTERM: uvicorn finishes its requests), SIGKILL after 10 s."""
        self.stopping = True
        if self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@dataclass
class Reporting:
    """The server this command reports to: its API URL, whose it is, the process when it is ours."""
    api_url: str
    whose: str
    """"configured" (Prefect's settings), "services" (`make services-up`) or "temporary"."""
    server: Optional[TemporaryServer] = None


_prewarmed: Optional[TemporaryServer] = None


def prewarm(home: Path) -> None:
    """Start the temporary server's process now, unless another server will obviously be used: the
    environment names one, or the local services' server answers (``choose`` decides for good)."""
    global _prewarmed
    if os.environ.get("PREFECT_API_URL") or running_prefect_api() is not None:
        return
    _prewarmed = TemporaryServer(home)


def choose(configured: Optional[str], temporary_allowed: bool, home: Path, timeout: float) -> Optional[Reporting]:
    """The server to report to (module docstring), the temporary one started here if that is the
    one; None when there is none and Prefect may not start one (it then says so itself)."""
    global _prewarmed
    prewarmed, _prewarmed = _prewarmed, None
    services = None if configured else running_prefect_api()
    if configured or services or not temporary_allowed:
        if prewarmed is not None:
            prewarmed.discard()
        if configured and not answers(configured):
            raise ServerStartError(f"the Prefect server at {configured} (PREFECT_API_URL or your Prefect profile) "
                                   "does not answer: start it (e.g. `make services-up`), or unset PREFECT_API_URL "
                                   "to run on a temporary server")
        return Reporting(configured, "configured") if configured else \
            Reporting(services, "services") if services else None
    server = prewarmed or TemporaryServer(home)
    return Reporting(server.start(timeout), "temporary", server)


def answers(api_url: str, timeout: float = 10.0) -> bool:
    """Whether anything answers at a server's address (any HTTP status: it is there)."""
    import httpx

    try:
        httpx.get(f"{api_url}/health", timeout=timeout)
    except httpx.TransportError:
        return False
    return True


class ServerWatch:
    """Calls ``on_gone(reason)`` once, from a daemon thread, when the server stops: our own
    server's process exits (seen within 0.25 s), or nothing listens at a server's address
    ``REFUSED_CHECKS`` times in a row (about as many seconds), or it gives no answer for
    ``SILENT_SECONDS``: a busy server is slow, not dead."""

    REFUSED_CHECKS = 3
    SILENT_SECONDS = 60.0

    def __init__(self, reporting: Reporting, on_gone: Callable[[str], None]):
        self.reporting = reporting
        self.on_gone = on_gone
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._run, name="prefect-server-watch", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.closed.set()

    def _run(self) -> None:
        server = self.reporting.server
        reason = self._process_gone(server) if server is not None else self._address_gone()
        if reason is not None and not self.closed.is_set():
            self.on_gone(reason)

    def _process_gone(self, server: TemporaryServer) -> Optional[str]:
        while not self.closed.wait(0.25) and not server.stopping:
            reason = server.exit_reason()
            if reason is not None and not server.stopping:  # stopping: rlhf stopped it at its exit
                return f"its process {reason}"
        return None

    def _address_gone(self) -> Optional[str]:
        import httpx

        refused, answered = 0, time.monotonic()
        while not self.closed.wait(1.0):
            try:
                httpx.get(f"{self.reporting.api_url}/health", timeout=5.0)
                refused, answered = 0, time.monotonic()
            except httpx.ConnectError:
                refused += 1
            except httpx.HTTPError:
                refused = 0  # something is there; it is slow
            if refused >= self.REFUSED_CHECKS:
                return "nothing listens at its address any more"
            if time.monotonic() - answered > self.SILENT_SECONDS:
                return f"it has not answered for {self.SILENT_SECONDS:.0f} s"
        return None
