"""What the engine test modules share: how an engine run is started and
read, and the demo talker's figures worked out by hand.

Each ``test_engine_*`` module starts its engines once (module fixtures) and
every test reads what a run produced: the plugin's startup report, the
engine's log, and what the demo model really held (its stats files).
Expected caps are computed by hand from the demo talker's geometry
(``talker_bytes_per_row``), never by calling the planner.

Nothing here imports vLLM: collecting a test module reads no vLLM; the
engines import it in their own processes.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kv_budget.units import GiB, MiB
from kv_budget_demo.checkpoint import DEFAULT_TALKER, talker_bytes_per_row
from kv_budget_demo.demo import read_peak_stats

HEADROOM = 96 * MiB
PER_SEQ = talker_bytes_per_row(DEFAULT_TALKER)  # 1,114,112 B: 2x4x2x64x256x4 + 2x1x2x64x64x4
CAP = HEADROOM // PER_SEQ  # 90
POOL = GiB  # VLLM_CPU_KVCACHE_SPACE=1 in both runners: vLLM's figure for the paged pool
TWO_WORKERS = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
"""``llm_kwargs`` of a tensor-parallel-2 run; its env needs :data:`TWO_CORES`."""
OMP_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
"""Which cores vllm-cpu binds each worker rank's threads to (``|`` between ranks)."""
TWO_CORES = {OMP_BIND_ENV: "0|1"}
"""One core per worker: vllm-cpu binds each rank's threads to its own cores."""
LLM_RUNNER = Path(__file__).with_name("engine_llm_run.py")


@functools.cache
def has_max_num_active_seqs() -> bool:
    """vLLM 0.30 has no ``max_num_active_seqs``; where it exists the cap must
    lower it too. Read from the installed vLLM when a test asks, not at import."""
    from vllm_patches.compat import InstalledVllm, detect_features

    return detect_features(InstalledVllm()).max_num_active_seqs


def active_seqs_flags() -> list[str]:
    """``--max-num-active-seqs 200`` where this vLLM has it: the cap must lower it too."""
    return ["--max-num-active-seqs", "200"] if has_max_num_active_seqs() else []


@dataclass
class LlmRun:
    returncode: int
    output: str
    result: dict | None
    report: dict | None
    stats: dict[int, dict]


def run_llm(checkpoint: Path, workdir: Path, settings: dict, env: dict | None = None, **extra) -> LlmRun:
    """``vllm.LLM(additional_config={"model_local_kv": settings})`` in its own
    process (tests/engine_llm_run.py); ``extra`` goes into the runner's spec
    (``requests``, ``max_tokens``, ``max_num_seqs``, ``llm_kwargs``)."""
    stats_dir = workdir / "stats"
    stats_dir.mkdir(parents=True)
    report = workdir / "report.json"
    spec = {
        "model": str(checkpoint),
        "stats_dir": str(stats_dir),
        "additional_config": {"model_local_kv": {**settings, "report_path": str(report)}},
        **extra,
    }
    proc = subprocess.run(
        [sys.executable, str(LLM_RUNNER), json.dumps(spec)], capture_output=True, text=True, timeout=900, env=env,
    )
    output = proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return LlmRun(
        returncode=proc.returncode,
        output=output,
        result=json.loads(lines[-1][len("RESULT "):]) if lines else None,
        report=json.loads(report.read_text()) if report.exists() else None,
        stats=read_peak_stats(stats_dir),
    )


def faulty_env(kind: str, rank: int = 0, **extra: str) -> dict:
    """This process's environment with one fault for engine_llm_run.py to inject."""
    return {**os.environ, "KV_BUDGET_TEST_FAULT": json.dumps({"kind": kind, "rank": rank}), **extra}


def kv_budget_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "kv-budget" in line]


def assert_refused_in_one_line(run: LlmRun, message: str) -> None:
    """The engine did not start, and one line of its output ends with ``message``."""
    assert run.returncode != 0 and run.result is None
    assert [line for line in run.output.splitlines() if line.endswith(message)], run.output[-3000:]


def kv_cache_tokens(log: str) -> int:
    """vLLM's own startup line: the pool it allocated, in tokens."""
    match = re.search(r"CPU KV cache size: ([\d,]+) tokens", log)
    assert match, "vLLM printed no KV cache size"
    return int(match.group(1).replace(",", ""))


def metrics_when(url: str, ready: Callable[[str], bool], awaited: str, timeout: float = 60) -> str:
    """The first ``/metrics`` body, read every 0.2 s, that ``ready`` accepts;
    after ``timeout`` s, a failure naming what was ``awaited`` and the last
    body's live counts."""
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            body = response.read().decode()
        if ready(body):
            return body
        counts = re.findall(r"^kv_budget:live_(?:held_sequences|completed_requests)\b.*$", body, re.M)
        assert time.monotonic() < deadline, f"/metrics did not show {awaited} after {timeout} s: {counts}"
        time.sleep(0.2)


def metrics_once_idle(url: str, status_file: Path) -> str:
    """The ``/metrics`` body once it shows the sample the engine took as its
    load drained: none held, as many completed as ``status_file`` (the
    engine's status) says. That sample may come after the last response
    went out, and vLLM's API server publishes it at its next stats log
    (``VLLM_LOG_STATS_INTERVAL``); read before, ``/metrics`` and the status
    file the engine leaves would describe two different samples."""
    def idle(body: str) -> bool:
        live = json.loads(status_file.read_text()).get("live") if status_file.exists() else None
        return live is not None and live["held_sequences"] == 0 and (
            _metric_or_none(body, "kv_budget:live_held_sequences"),
            _metric_or_none(body, "kv_budget:live_completed_requests")) == (0, live["completed_requests"])
    return metrics_when(url, idle, f"the engine's idle sample in {status_file}")


def _metric_or_none(body: str, name: str) -> float | None:
    return metric_sum(body, name) if re.search(rf"^{re.escape(name)}[{{ ]", body, re.M) else None


def metric_sum(body: str, name: str) -> float:
    """The sum of ``name`` over its label sets in a /metrics body."""
    values = re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", body, re.M)
    assert values, f"{name} is not on /metrics"
    return sum(float(value) for value in values)
