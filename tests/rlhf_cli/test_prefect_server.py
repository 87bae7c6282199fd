"""rlhf_cli.prefect_server on real sockets and processes: the watch notices a server that stops
listening within seconds and does not take a slow or failing one for dead; a configured server that
does not answer is one error naming PREFECT_API_URL and the fix; a pre-started temporary server
whose `rlhf` is gone leaves at once, without ever listening."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import psutil
import pytest

from rlhf_cli.prefect_server import LOG_NAME, Reporting, ServerStartError, ServerWatch, choose


def _serving(status: int) -> tuple[ThreadingHTTPServer, str]:
    """A real HTTP server on 127.0.0.1 answering every GET with ``status``; returns it and its API URL."""
    class Answer(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/api"


def _watch(api_url: str) -> tuple[ServerWatch, list[str], threading.Event]:
    reasons, gone = [], threading.Event()
    watch = ServerWatch(Reporting(api_url, "configured"), lambda reason: (reasons.append(reason), gone.set()))
    return watch, reasons, gone


def test_the_watch_notices_a_server_that_stops_listening():
    server, url = _serving(200)
    watch, reasons, gone = _watch(url)
    try:
        assert not gone.wait(2.5)  # it answers: nothing to say
        server.shutdown()
        server.server_close()
        stopped_at = time.monotonic()
        assert gone.wait(15), "the watch did not notice within 15 s"
        assert reasons == ["nothing listens at its address any more"]
        assert time.monotonic() - stopped_at < ServerWatch.REFUSED_CHECKS + 3
    finally:
        watch.close()


def test_a_server_that_answers_with_an_error_is_not_dead():
    server, url = _serving(503)  # a busy Prefect server's answer
    watch, reasons, gone = _watch(url)
    try:
        assert not gone.wait(ServerWatch.REFUSED_CHECKS + 1.5), reasons
    finally:
        watch.close()
        server.shutdown()
        server.server_close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_configured_server_that_does_not_answer_is_one_error_with_the_fix(tmp_path):
    url = f"http://127.0.0.1:{_free_port()}/api"
    with pytest.raises(ServerStartError) as caught:
        choose(url, temporary_allowed=True, home=tmp_path, timeout=5)
    message = str(caught.value)
    assert url in message and "PREFECT_API_URL" in message and "make services-up" in message, message
    assert "\n" not in message


# a stand-in for `rlhf`: pre-starts the temporary server, prints its PID, and is gone at once
PARENT = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from rlhf_cli.prefect_server import TemporaryServer
    server = TemporaryServer(Path(sys.argv[1]))
    print(server.process.pid, flush=True)
    os._exit(0)  # as after kill -9: no exit hook runs
""")


def test_a_prestarted_server_leaves_at_once_when_rlhf_is_gone(tmp_path):
    out = subprocess.run([sys.executable, "-c", PARENT, str(tmp_path)], capture_output=True, text=True, timeout=60,
                         check=True)
    server = psutil.Process(int(out.stdout))
    try:
        server.wait(5)  # it looks for its parent every 0.25 s; left alone it would go on importing and migrating
    except psutil.TimeoutExpired:
        server.kill()
        pytest.fail("the pre-started server outlived its rlhf by 5 s")
    assert not (tmp_path / LOG_NAME).exists()  # it never started listening
