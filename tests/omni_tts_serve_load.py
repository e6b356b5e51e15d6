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

**Voice clones** (Qwen3-TTS Base, in-context: ``reference`` and/or
``clone_every``): the request names no voice and carries, through the
client's ``extra_body`` (fields of vLLM-Omni's ``OpenAICreateSpeechRequest``,
``protocol/audio.py``), ``task_type: "Base"``, ``ref_audio`` (the reference
WAV as a base64 ``data:audio/wav`` URL, one of the URL forms the endpoint
accepts), ``ref_text`` (its transcript, required in-context),
``x_vector_only_mode: false`` (in-context: the talker is given the
reference's codes and code2wav decodes them as the first chunk's left
context) and ``max_new_tokens`` (:data:`CLONE_MAX_NEW_TOKENS`, see there).
The endpoint wants a reference of 1 to 30 s; it must be at the model's
24 kHz here (resampling needs torchaudio, absent): :func:`reference_wav`
makes one.

Usage: ``python tests/omni_tts_serve_load.py URL --model NAME [--requests 256] [--voice vivian] [--stream]
[--clone-every N]``
"""

from __future__ import annotations

import base64
import io
import json
import math
import random
import struct
import threading
import time
import wave
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

__all__ = ["WavInfo", "SpeechResult", "SpeechLoad", "parse_wav", "send_speech", "reference_wav",
           "DEFAULT_REFERENCE_TEXT", "CLONE_MAX_NEW_TOKENS"]

DEFAULT_TEXT = "Admission control keeps model-local caches within the memory a stage was given."
DEFAULT_REFERENCE_TEXT = "This is the reference voice."
"""Transcript sent with :func:`reference_wav`'s audio (the model never checks it against the audio)."""
REFERENCE_SAMPLE_RATE = 24000
REFERENCE_SECONDS = 1.0
"""The shortest reference vLLM-Omni's speech endpoint accepts (``_REF_AUDIO_MIN_DURATION``)."""

try:
    from kv_budget_omni_cpu.qwen3_tts_deploy import FRAMES as _DEPLOY_FRAMES
except ImportError:  # the load runs from any interpreter with the openai client
    _DEPLOY_FRAMES = 150
CLONE_MAX_NEW_TOKENS = _DEPLOY_FRAMES + 1
"""A clone's codec budget: the deploy's fixed frames (``min_tokens`` =
``max_tokens``) and one step more for end of speech. Why: vLLM-Omni refuses
a Base generation that ended on its budget (``Qwen3TTSAdapter.
validate_generation``: ``finish_reason`` ``length``, HTTP 500), and an
explicit budget lifts the deploy's ``max_tokens`` (``min_tokens`` stays), so
the talker of ``kv_budget_omni_cpu.qwen3_tts_checkpoint``, which ends speech
as soon as it may, stops on its own after exactly the deploy's frames."""


def reference_wav(seconds: float = REFERENCE_SECONDS, sample_rate: int = REFERENCE_SAMPLE_RATE,
                  seed: int = 0) -> bytes:
    """A deterministic mono 16-bit PCM WAV: a gliding tone with a vibrato and a little noise."""
    rng = random.Random(seed)
    frames = bytearray()
    count = int(round(seconds * sample_rate))
    for n in range(count):
        t = n / sample_rate
        phase = 2 * math.pi * (140 * t + 60 * t * t + 2 * math.sin(2 * math.pi * 5 * t))
        value = 0.3 * math.sin(phase) + 0.1 * math.sin(3 * phase) + 0.02 * rng.gauss(0, 1)
        frames += struct.pack("<h", max(-32768, min(32767, int(value * 32767))))
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(sample_rate)
        out.writeframes(bytes(frames))
    return buffer.getvalue()


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
    task: str = "CustomVoice"
    """``Base`` for a voice clone, ``CustomVoice`` for a preset voice."""

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
            "by_task": {task: {"requests": sum(r.task == task for r in self.results),
                               "valid_wav_with_audio": sum(r.valid_audio for r in self.results if r.task == task),
                               "audio_bytes": sorted({r.audio_bytes for r in self.results
                                                      if r.task == task and r.status == "ok"})[:4]}
                        for task in sorted({r.task for r in self.results})},
        }


def send_speech(base_url: str, model: str, requests: int, *, voice: str | None = None, text: str = DEFAULT_TEXT,
                response_format: str = "wav", stream: bool = False, timeout: float = 300.0,
                reference: tuple[bytes, str] | None = None, clone_every: int = 0,
                clone_max_new_tokens: int | None = CLONE_MAX_NEW_TOKENS) -> SpeechLoad:
    """Send ``requests`` speech requests at once; every one gets its own thread.

    Voice clones: ``reference`` is ``(wav bytes, transcript)``; ``clone_every``
    N makes requests 0, N, 2N... clones (1: all, 2: half; 0: none, or all
    when a ``reference`` is given). A clone without a ``reference`` uses
    :func:`reference_wav` and :data:`DEFAULT_REFERENCE_TEXT`; the others
    are preset voices (``voice``)."""
    from openai import OpenAI

    if reference is not None and clone_every <= 0:
        clone_every = 1
    if clone_every > 0 and reference is None:
        reference = (reference_wav(), DEFAULT_REFERENCE_TEXT)
    client = OpenAI(base_url=f"{base_url.rstrip('/')}/v1", api_key="EMPTY", max_retries=0, timeout=timeout)
    barrier = threading.Barrier(requests)
    # The client requires ``voice``; sent as null, vLLM-Omni's endpoint uses its default speaker.
    preset = {"model": model, "input": text, "voice": voice, "response_format": response_format}
    clone = None
    if reference is not None:
        audio, transcript = reference
        extra = {"task_type": "Base", "ref_audio": "data:audio/wav;base64," + base64.b64encode(audio).decode("ascii"),
                 "ref_text": transcript, "x_vector_only_mode": False}
        if clone_max_new_tokens is not None:
            extra["max_new_tokens"] = clone_max_new_tokens
        clone = {**preset, "voice": None, "extra_body": extra}

    def one(index: int) -> SpeechResult:
        is_clone = clone is not None and index % clone_every == 0
        kwargs, task = (clone, "Base") if is_clone else (preset, "CustomVoice")
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
            return SpeechResult(index, type(exc).__name__, seconds=time.monotonic() - began, error=str(exc)[:300],
                                task=task)
        return SpeechResult(index, "ok", len(data), time.monotonic() - began, first,
                            parse_wav(data) if response_format == "wav" else None, task=task)

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
    parser.add_argument("--clone-every", type=int, default=0,
                        help="every Nth request a voice clone (1: all) with reference_wav()")
    parser.add_argument("--json", help="write every result here")
    args = parser.parse_args(argv)
    load = send_speech(args.url, args.model, args.requests, voice=args.voice, text=args.text,
                       response_format=args.response_format, stream=args.stream, clone_every=args.clone_every)
    print(json.dumps(load.summary(), indent=2))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"summary": load.summary(), "results": [asdict(r) for r in load.results]}, out, indent=1)
    return 0 if load.valid == load.requests or (args.response_format == "pcm" and load.ok == load.requests) else 1


if __name__ == "__main__":
    raise SystemExit(main())
