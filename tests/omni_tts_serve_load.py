"""Concurrent ``/v1/audio/speech`` requests with the official ``openai`` client, read back.

Test support, not vLLM-Omni code and not part of kv-budget. It starts
nothing: given the base URL of a running ``vllm serve MODEL --omni`` API
server (vLLM-Omni's own, see tests/omni_serve_run.py) it sends N requests
at once through ``openai.OpenAI().audio.speech.create`` (one thread each,
all released together, as kv_budget_demo.serving does for completions) and
returns, per request, its status, the audio bytes and what their WAV header
says. With ``stream=True`` each request asks vLLM-Omni's raw audio stream
(``stream_format="audio"``, through the client's ``with_streaming_response``)
and its time to first byte is kept too.

Valid values with a Qwen3-TTS CustomVoice checkpoint (vLLM-Omni's
``entrypoints/openai/tts_adapters/qwen3_tts.py``): ``voice`` is one of the
checkpoint's ``talker_config.spk_id`` names (lower case) or omitted (the
first one is the default); ``response_format`` ``wav`` or ``pcm`` (the two
it can stream); ``model`` the served model name (the checkpoint path unless
``--served-model-name`` says otherwise).

Usage: ``python tests/omni_tts_serve_load.py URL --model NAME [--requests 256] [--voice vivian] [--stream]``
"""

from __future__ import annotations

import json
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

__all__ = ["WavInfo", "SpeechResult", "SpeechLoad", "parse_wav", "send_speech"]

DEFAULT_TEXT = "Admission control keeps model-local caches within the memory a stage was given."


@dataclass(frozen=True)
class WavInfo:
    sample_rate: int
    channels: int
    bits_per_sample: int
    data_bytes: int
    """Bytes after the ``data`` chunk header actually received (a streamed
    WAV header may announce an unknown size)."""

    @property
    def samples(self) -> int:
        return self.data_bytes // max(1, self.channels * self.bits_per_sample // 8)


def parse_wav(data: bytes) -> WavInfo | None:
    """The ``fmt `` and ``data`` chunks of a RIFF/WAVE byte string; None when it is not one."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    offset, fmt = 12, None
    while offset + 8 <= len(data):
        chunk, size = data[offset:offset + 4], struct.unpack_from("<I", data, offset + 4)[0]
        body = offset + 8
        if chunk == b"fmt " and body + 16 <= len(data):
            _, channels, rate, _, _, bits = struct.unpack_from("<HHIIHH", data, body)
            fmt = (rate, channels, bits)
        elif chunk == b"data":
            if fmt is None:
                return None
            return WavInfo(fmt[0], fmt[1], fmt[2], len(data) - body)
        offset = body + size + (size & 1)
    return None


@dataclass
class SpeechResult:
    index: int
    status: str
    """``ok``, or the exception's class name."""
    audio_bytes: int = 0
    seconds: float = 0.0
    first_byte_seconds: float | None = None
    """Streaming only: from sending to the first audio bytes."""
    wav: WavInfo | None = None
    error: str = ""

    @property
    def valid_audio(self) -> bool:
        """HTTP 200, a WAV header, and audio samples after it."""
        return self.status == "ok" and self.wav is not None and self.wav.data_bytes > 0


@dataclass
class SpeechLoad:
    requests: int
    seconds: float
    results: list[SpeechResult] = field(default_factory=list)

    @property
    def ok(self) -> int:
        return sum(result.status == "ok" for result in self.results)

    @property
    def valid(self) -> int:
        return sum(result.valid_audio for result in self.results)

    @property
    def errors(self) -> list[str]:
        return [f"{r.index}: {r.status}: {r.error}" for r in self.results if r.status != "ok"]

    def summary(self) -> dict:
        sizes = [r.audio_bytes for r in self.results if r.status == "ok"]
        ttfb = sorted(r.first_byte_seconds for r in self.results if r.first_byte_seconds is not None)
        latencies = sorted(r.seconds for r in self.results if r.status == "ok")
        wavs = {(r.wav.sample_rate, r.wav.channels, r.wav.bits_per_sample) for r in self.results if r.wav}
        return {
            "requests": self.requests, "ok": self.ok, "valid_wav_with_audio": self.valid,
            "wall_seconds": round(self.seconds, 3),
            "audio_bytes_min": min(sizes, default=0), "audio_bytes_max": max(sizes, default=0),
            "latency_p50_seconds": round(latencies[len(latencies) // 2], 3) if latencies else None,
            "latency_max_seconds": round(latencies[-1], 3) if latencies else None,
            "first_byte_p50_seconds": round(ttfb[len(ttfb) // 2], 3) if ttfb else None,
            "first_byte_max_seconds": round(ttfb[-1], 3) if ttfb else None,
            "wav_formats": sorted(wavs), "errors": self.errors[:5],
        }


def send_speech(base_url: str, model: str, requests: int, *, voice: str | None = None, text: str = DEFAULT_TEXT,
                response_format: str = "wav", stream: bool = False, timeout: float = 300.0) -> SpeechLoad:
    """Send ``requests`` speech requests at once; every one gets its own thread."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url.rstrip('/')}/v1", api_key="EMPTY", max_retries=0, timeout=timeout)
    barrier = threading.Barrier(requests)
    # The client requires ``voice``; sent as null, vLLM-Omni's endpoint uses its default speaker.
    kwargs = {"model": model, "input": text, "voice": voice, "response_format": response_format}

    def one(index: int) -> SpeechResult:
        barrier.wait()
        began = time.monotonic()
        try:
            if stream:
                first = None
                chunks = []
                with client.audio.speech.with_streaming_response.create(**kwargs, stream_format="audio") as response:
                    for chunk in response.iter_bytes():
                        if chunk and first is None:
                            first = time.monotonic() - began
                        chunks.append(chunk)
                data = b"".join(chunks)
            else:
                first = None
                data = client.audio.speech.create(**kwargs).content
        except Exception as exc:  # the status of this request, not the run's
            return SpeechResult(index, type(exc).__name__, seconds=time.monotonic() - began, error=str(exc)[:300])
        return SpeechResult(index, "ok", len(data), time.monotonic() - began, first,
                            parse_wav(data) if response_format == "wav" else None)

    began = time.monotonic()
    with ThreadPoolExecutor(max_workers=requests) as pool:
        results = list(pool.map(one, range(requests)))
    load = SpeechLoad(requests, time.monotonic() - began, results)
    client.close()
    return load


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("--model", required=True)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--voice", default=None)
    parser.add_argument("--text", default=DEFAULT_TEXT)
    parser.add_argument("--response-format", default="wav", choices=("wav", "pcm"))
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--json", help="write every result here")
    args = parser.parse_args(argv)
    load = send_speech(args.url, args.model, args.requests, voice=args.voice, text=args.text,
                       response_format=args.response_format, stream=args.stream)
    print(json.dumps(load.summary(), indent=2))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"summary": load.summary(), "results": [asdict(r) for r in load.results]}, out, indent=1)
    return 0 if load.valid == load.requests or (args.response_format == "pcm" and load.ok == load.requests) else 1


if __name__ == "__main__":
    raise SystemExit(main())
