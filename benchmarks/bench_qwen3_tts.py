"""256 concurrent speech requests to vLLM-Omni's own Qwen3-TTS deployment, without and with kv-budget.

Why: the claim is that kv-budget bounds what vLLM-Omni's Qwen3-TTS code2wav
stage keeps per request (the decoder's ``_decoder_state_cache`` and its
working copies) within the headroom an operator gives, on vLLM-Omni's own
pipeline (talker -> code2wav, async chunking, its API server), and what that
costs in speech served. Each run is a fresh ``vllm serve MODEL --omni``
(``tests/omni_serve_run.py``) with the shipped deploy as
``kv_budget_omni_cpu.qwen3_tts_deploy`` adapts it to this machine, the small
random checkpoint of ``kv_budget_omni_cpu.qwen3_tts_checkpoint``, and 256
requests at once through the ``openai`` client, all voice clones by default
(a clone keeps its reference's KV in code2wav per request; a preset voice
keeps none, ``--clone-every 2`` mixes them), all streamed
(``stream_format="audio"``) so time to first audio is measured:

* ``off``: ``--model-local-kv-policy off``, stock vLLM-Omni;
* ``cap``: ``--model-local-kv-policy cap --model-local-kv-headroom
  HEADROOM``, the decoder declaring its caches as on CUDA (the test
  support's ``KV_BUDGET_TTS_DECLARE``) with the audit's corrections as
  operator overrides, the same figures as tests/test_omni_qwen3_tts_serve.py.

Per run: requests with valid audio, seconds of audio returned per second of
wall time, time to first audio (median, p99) and to the last byte, and in
stage 1 the test support's own count (``KV_BUDGET_TTS_PROBE_DIR``: plain
torch storages, no kv-budget code): the most requests whose caches were
kept at once, and the most bytes held at once, against the headroom.

    .venv-omni-serve/bin/python benchmarks/bench_qwen3_tts.py          # JSON into benchmarks/results/
    .venv-omni-serve/bin/python benchmarks/bench_qwen3_tts.py --requests 64 --no-json   # to try it out

About 2 x 2 minutes on 2 cores. Needs ``make venv-omni-serve``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from machine import write_results

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the API-server runner and the speech load are test support

from omni_pipeline_support import OmniApiServer  # noqa: E402
from omni_tts_serve_load import send_speech  # noqa: E402

from kv_budget.units import format_bytes, parse_byte_size  # noqa: E402

ROW = 256
"""One position of one decoder row: 2 (K, V) x 2 layers x 2 KV heads x 16 x 2 B (bfloat16)."""
CORRECTIONS = [
    "1:decoder/codec_decoder_request:physical_capacity_positions=71",
    "1:decoder/codec_decoder_request:capacity_source=sliding_window (storage held)",
    "1:decoder/codec_decoder_working_copy:physical_capacity_positions=239",
    "1:decoder/codec_decoder_working_copy:capacity_source=working copy + batched copy at their peak",
    "1:decoder/codec_decoder_working_copy:rows=fixed",
    "1:decoder/codec_decoder_working_copy:rows_fixed=4",
    "1:decoder/codec_decoder_working_copy:rows_reason=decode_batch_max_size 4 caps each eager decode group",
]
"""As tests/test_omni_qwen3_tts_serve.py gives them (docs/vllm-omni-qwen3-tts.md says why)."""


def log(message: str) -> None:
    print(f"[bench_qwen3_tts {time.strftime('%H:%M:%S')}] {message}", flush=True)


def percentile(values: list[float], fraction: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(fraction * len(ordered) + 0.5)) - 1))]


def metric(metrics: str, name: str, stage: str = "1") -> float | None:
    for labels, value in re.findall(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", metrics, re.M):
        if f'stage="{stage}"' in labels:
            return float(value)
    return None


def run(policy: str, work: Path, requests: int, headroom: int, clone_every: int) -> dict:
    from kv_budget_omni_cpu.qwen3_tts_checkpoint import write_qwen3_tts_checkpoint
    from kv_budget_omni_cpu.qwen3_tts_deploy import qwen3_tts_deploy
    from kv_budget_omni_cpu.qwen3_tts_probe import DECLARE_ENV, PROBE_ENV, read_probes

    checkpoint = write_qwen3_tts_checkpoint(work / "ckpt")
    deploy = qwen3_tts_deploy(work)
    for directory in ("probe", "reports", "status"):
        (work / directory).mkdir()
    flags = ["--model-local-kv-policy", policy, "--model-local-kv-ledger-dir", "off"]
    env = {PROBE_ENV: str(work / "probe"), "KV_BUDGET_STATUS_DIR": str(work / "status")}
    if policy == "cap":
        flags += ["--model-local-kv-headroom", str(headroom), "--model-local-kv-report",
                  str(work / "reports" / "plan.json")]
        flags += [arg for text in CORRECTIONS for arg in ("--model-local-kv-override", text)]
        env[DECLARE_ENV] = "1"
    api = OmniApiServer(model=str(checkpoint), log_path=work / "server.log", deploy=str(deploy.path),
                        extra_args=flags, env=env)
    started = time.monotonic()
    api.start(timeout=600)
    startup_s = time.monotonic() - started
    try:
        load = send_speech(api.url, str(checkpoint), requests, clone_every=clone_every, stream=True)
        with urllib.request.urlopen(f"{api.url}/metrics", timeout=10) as response:
            metrics = response.read().decode()
    finally:
        api.stop()
    probes = [p for p in read_probes(work / "probe") if p["forwards"]]
    probe = probes[0] if len(probes) == 1 else {}
    audio_s = sum(r.wav.samples / r.wav.sample_rate for r in load.results if r.valid_audio)
    first = [r.first_byte_seconds for r in load.results if r.first_byte_seconds is not None]
    latency = [r.seconds for r in load.results if r.status == "ok"]
    report_path = work / "reports" / "plan.stage1-replica0.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    return {
        "policy": policy,
        "requests": requests,
        "clone_every": clone_every,
        "valid_audio": load.valid,
        "errors": load.errors[:3],
        "startup_seconds": round(startup_s, 1),
        "wall_seconds": round(load.seconds, 2),
        "audio_seconds": round(audio_s, 2),
        "audio_seconds_per_second": round(audio_s / load.seconds, 3) if load.seconds else None,
        "first_audio_p50_seconds": round(percentile(first, 0.5), 3) if first else None,
        "first_audio_p99_seconds": round(percentile(first, 0.99), 3) if first else None,
        "last_byte_p50_seconds": round(percentile(latency, 0.5), 3) if latency else None,
        "last_byte_p99_seconds": round(percentile(latency, 0.99), 3) if latency else None,
        "stage1_max_num_seqs": report["effective_max_num_seqs"] if report else None,
        "stage1_requests_kept_at_once": probe.get("entries_peak"),
        "stage1_kept_peak_bytes": probe.get("retained_peak_bytes"),
        "stage1_at_once_peak_bytes": probe.get("at_once_peak_bytes"),
        "stage1_kv_budget_live_peak_bytes": metric(metrics, "kv_budget:live_peak_bytes"),
        "count_source": "kv_budget_omni_cpu.qwen3_tts_probe in stage 1 (plain torch storages)",
        "parked_requests_counted": "retains_state_across_chunks False -> True" in api.log_text(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--headroom", default="4MiB", help="the operator's headroom under cap (default 4MiB)")
    parser.add_argument("--policies", default="off,cap")
    parser.add_argument("--clone-every", type=int, default=1, help="every Nth request a voice clone (1: all)")
    parser.add_argument("--json", default=str(HERE / "results" / "qwen3_tts.json"))
    parser.add_argument("--no-json", action="store_true")
    args = parser.parse_args(argv)
    headroom = parse_byte_size(args.headroom)
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-qwen3-tts-") as tmp:
        for policy in args.policies.split(","):
            log(f"{policy}: starting vllm serve --omni, then {args.requests} concurrent speech requests")
            result = run(policy, Path(tmp) / policy, args.requests, headroom, args.clone_every)
            runs.append(result)
            log(f"{policy}: {result['valid_audio']}/{result['requests']} with audio in {result['wall_seconds']} s; "
                f"{result['audio_seconds_per_second']} s of audio per s; first audio p50 "
                f"{result['first_audio_p50_seconds']} s, p99 {result['first_audio_p99_seconds']} s; stage 1 kept "
                f"{result['stage1_requests_kept_at_once']} requests' caches at once, held at most "
                f"{format_bytes(result['stage1_at_once_peak_bytes'] or 0)} "
                f"({'within' if (result['stage1_at_once_peak_bytes'] or 0) <= headroom else 'over'} the headroom "
                f"{format_bytes(headroom)})")
    out = {"benchmark": "bench_qwen3_tts", "headroom_bytes": headroom, "headroom": args.headroom, "runs": runs}
    print(json.dumps(out, indent=2))
    if not args.no_json:
        write_results(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
