"""The demo's api_server harness, on stand-in server processes (a few lines
of Python each): what it takes for started and stopped is what every engine
test relies on, and a mistake there shows up as a wrong figure in some
other test."""

from __future__ import annotations

import http.server
import sys
import threading
import time
from dataclasses import dataclass, field

import psutil
import pytest

from kv_budget_demo.serving import ApiServer, ServerStartError, free_port


class _Healthy(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (the handler's name is http.server's)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@dataclass
class _Scripted(ApiServer):
    """An :class:`ApiServer` whose process runs ``script`` instead of vLLM."""

    script: str = ""
    args: list[str] = field(default_factory=list)

    def command(self) -> list[str]:
        return [sys.executable, "-c", self.script, *self.args]


def test_another_server_answering_on_the_port_is_not_taken_for_this_one(tmp_path):
    other = http.server.HTTPServer(("127.0.0.1", 0), _Healthy)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        # This server never listens, as one that lost its port to the other would; it exits after 3 s.
        server = _Scripted(model="m", log_path=tmp_path / "server.log", port=other.server_address[1],
                           script="import time; time.sleep(3)")
        with pytest.raises(ServerStartError, match="exited with code 0 during startup"):
            server.start(timeout=30)
    finally:
        other.shutdown()


SLOW_CHILD = """
import http.server, subprocess, sys
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); print(flush=True); time.sleep(120)"],
    stdout=subprocess.PIPE)
child.stdout.readline()
open(sys.argv[1], "w").write(str(child.pid))
class Healthy(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[2])), Healthy).serve_forever()
"""


def test_stopping_leaves_no_child_of_the_server_running(tmp_path):
    """A child that ignores the interrupt (an engine core slow to shut down)
    would go on holding memory and its ledger entry after the server."""
    child_pid, port = tmp_path / "child.pid", free_port()
    server = _Scripted(model="m", log_path=tmp_path / "server.log", port=port, script=SLOW_CHILD,
                       args=[str(child_pid), str(port)]).start(timeout=30)
    child = psutil.Process(int(child_pid.read_text()))
    try:
        server.stop()
        deadline = time.monotonic() + 10
        while _running(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(child)
    finally:
        if _running(child):
            child.kill()


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
