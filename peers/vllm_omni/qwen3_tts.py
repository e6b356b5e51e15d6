"""vLLM-Omni 0.30.0's Qwen3-TTS codec decoder, built and run on the CPU for the audit.

Why: Qwen3-TTS's code2wav stage keeps sliding-window attention KV per request
(``DynamicCache`` objects in its ``_decoder_state_cache``) outside vLLM's paged
pool, and declares it only when its decoder has a CUDA-graph wrapper in
async-chunk mode. Whether those declarations match what the code really holds
can only be answered by running vLLM-Omni's own code, not a look-alike, so
everything here builds and drives the real objects:

* the stage model ``Qwen3TTSCode2Wav`` (``qwen3_tts/qwen3_tts_code2wav.py``),
  constructed from a real ``VllmConfig`` whose model config is vLLM-Omni's
  ``OmniModelConfig`` (made by its own ``from_vllm_model_config``), with its
  weights loaded by its own ``load_weights`` through vLLM's loader;
* its decoder ``Qwen3TTSTokenizerV2Decoder`` (``tokenizer_12hz/``), which the
  stage builds from a tokenizer config on disk;
* optionally the real ``CUDAGraphDecoderWrapper``
  (``segmented_graph_wrapper.py``), constructed on the CPU with the arguments
  ``enable_cudagraph`` passes and attached without warmup, so the decoder
  declares what a CUDA deployment declares while the eager path runs.

Requests go through ``Qwen3TTSCode2Wav.forward`` exactly as the model runner
hands them over: concatenated codebook-major codec ids, ``seq_token_counts``,
scheduler ``request_ids`` and per-request ``meta`` (request id, ICL reference
size) in ``runtime_additional_information``.

What is not vLLM-Omni's here: a small model directory written to a temporary
folder (a minimal ``config.json`` with ``model_type: qwen3_tts``, the
tokenizer config with a small decoder, and random weights saved from the
stage's own freshly built decoder), the registration of ``qwen3_tts`` with
``AutoConfig`` and of ``Qwen3TTSCode2Wav`` with vLLM's ``ModelRegistry``
(vLLM-Omni does both in ``engine/arg_utils.py``, ``register_omni_models_to_vllm``,
when its engine arguments are built, which does not happen here), and the
codec ids (random). The decoder keeps the real ``sliding_window`` of 72 and
the deploy file's chunking (first chunk 1 frame, then 25); only its width is
small (2 layers, 2 KV heads of 16, bfloat16 as ``deploy/qwen3_tts.yaml``).

The working copy of the cache lives only inside one decoder call, so no audit
of a model at rest can see it. :func:`measure` observes it with a forward hook
on ``decoder.pre_transformer`` that reads the caller's frame (nothing in
vLLM-Omni's code is changed); :func:`async_chunk_declared_at_peak` keeps a
reference to the invocation caches of the largest step so ``kv-budget audit``
sees them as they were at their peak. That reference is the one attribute on
the stage that vLLM-Omni did not make; it is named ``kv_budget_invocation_peak``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import types
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kv_budget.sample.caches import cache_breakdown, measure_cache_bytes
from peers.vllm_omni.files import import_omni_module

if "vllm" not in sys.modules:
    # vLLM logs to stdout by default; `kv-budget audit --json` prints its
    # report there. An operator's own setting wins.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

__all__ = [
    "WINDOW",
    "LAYERS",
    "KV_HEADS",
    "HEAD_DIM",
    "DTYPE",
    "NUM_QUANTIZERS",
    "FIRST_CHUNK_FRAMES",
    "CHUNK_FRAMES",
    "DECODE_BATCH_MAX_SIZE",
    "bytes_per_position_row",
    "build_stage",
    "attach_graph_wrapper",
    "InvocationProbe",
    "drive",
    "async_chunk_eager",
    "async_chunk_declared",
    "async_chunk_declared_at_peak",
    "async_chunk_fallback_declared",
    "stateless",
    "stateless_declared",
    "measure",
    "watch_in_step",
]

_PKG = "vllm_omni.model_executor.models.qwen3_tts"
_MODELING = f"{_PKG}.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2"
_TOKENIZER_CONFIG = f"{_PKG}.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2"
_STAGE = f"{_PKG}.qwen3_tts_code2wav"
_WRAPPER = f"{_PKG}.segmented_graph_wrapper"
_TTS_CONFIG = f"{_PKG}.configuration_qwen3_tts"
_OMNI_MODEL_CONFIG = "vllm_omni.config.model"

WINDOW = 72
"""``sliding_window`` of the real checkpoint (and the config default); kept."""
LAYERS = 2
KV_HEADS = 2
HEAD_DIM = 16
"""Small width: hidden 64 over 4 query heads gives head_dim 16; 2 KV heads
(grouped-query) so a declaration that used query heads would show."""
DTYPE = torch.bfloat16
"""The code2wav stage's dtype in ``deploy/qwen3_tts.yaml``."""
NUM_QUANTIZERS = 4
FIRST_CHUNK_FRAMES = 1
CHUNK_FRAMES = 25
DECODE_BATCH_MAX_SIZE = 4
"""``initial_codec_chunk_frames``, ``codec_chunk_frames`` and
``decode_batch_max_size`` of ``deploy/qwen3_tts.yaml``'s connector; passed
in the stage connector config so ``load_weights`` sets them itself."""
CODEBOOK_SIZE = 64

_DECODER_CONFIG = dict(
    num_hidden_layers=LAYERS,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=KV_HEADS,
    sliding_window=WINDOW,
    latent_dim=32,
    codebook_size=CODEBOOK_SIZE,
    codebook_dim=32,
    num_quantizers=NUM_QUANTIZERS,
    upsample_rates=(2, 2),
    upsampling_ratios=(2, 2),
    decoder_dim=32,
    intermediate_size=64,
)
_CONNECTOR_EXTRA = {
    "codec_chunk_frames": CHUNK_FRAMES,
    "codec_left_context_frames": WINDOW,
    "initial_codec_chunk_frames": FIRST_CHUNK_FRAMES,
    "decode_batch_max_size": DECODE_BATCH_MAX_SIZE,
}


def bytes_per_position_row() -> int:
    """K and V bytes of one position of one row across all layers, from the
    geometry above (never from a measurement): 2 x layers x kv heads x
    head_dim x dtype size. Every figure in positions is bytes divided by this."""
    return 2 * LAYERS * KV_HEADS * HEAD_DIM * torch.empty((), dtype=DTYPE).element_size()


# --------------------------------------------------------------------------
# Building the real objects

_state: dict[str, Any] = {}


def _modules() -> types.SimpleNamespace:
    """vLLM-Omni's modules, imported once. Registers what vLLM-Omni's
    ``register_omni_models_to_vllm`` would (the ``qwen3_tts`` config type,
    the stage architecture) so vLLM's ``ModelConfig`` accepts the model."""
    if "modules" in _state:
        return _state["modules"]
    from transformers import AutoConfig
    from vllm.model_executor.models import ModelRegistry

    ns = types.SimpleNamespace(
        modeling=import_omni_module(_MODELING),
        tokenizer_config=import_omni_module(_TOKENIZER_CONFIG),
        stage=import_omni_module(_STAGE),
        wrapper=import_omni_module(_WRAPPER),
        tts_config=import_omni_module(_TTS_CONFIG),
        omni_model_config=import_omni_module(_OMNI_MODEL_CONFIG),
    )
    try:
        AutoConfig.register("qwen3_tts", ns.tts_config.Qwen3TTSConfig)
    except ValueError:  # already registered in this process
        pass
    ModelRegistry.register_model("Qwen3TTSCode2Wav", ns.stage.Qwen3TTSCode2Wav)
    _state["modules"] = ns
    return ns


def _model_dir() -> Path:
    """A model directory the stage can load: the top-level config names the
    stage architecture, ``speech_tokenizer/`` holds the small decoder config.
    Weights are written by :func:`build_stage` once, from a decoder built by
    the stage itself. Kept for the life of the process."""
    if "dir" not in _state:
        ns = _modules()
        holder = tempfile.TemporaryDirectory(prefix="kv-budget-qwen3-tts-")
        root = Path(holder.name)
        (root / "config.json").write_text(
            json.dumps({"model_type": "qwen3_tts", "architectures": ["Qwen3TTSCode2Wav"]})
        )
        config = ns.tokenizer_config.Qwen3TTSTokenizerV2Config(decoder_config=dict(_DECODER_CONFIG))
        config.save_pretrained(str(root / "speech_tokenizer"))
        _state["dir_holder"] = holder
        _state["dir"] = root
    return _state["dir"]


def _vllm_config(async_chunk: bool) -> Any:
    """A real ``VllmConfig`` for the code2wav stage: vLLM's ``ModelConfig``
    turned into vLLM-Omni's ``OmniModelConfig`` by its own
    ``from_vllm_model_config``, as its stage builder does."""
    from vllm.config import ModelConfig, VllmConfig

    ns = _modules()
    model_config = ModelConfig(model=str(_model_dir()), dtype=str(DTYPE).removeprefix("torch."), max_model_len=65536)
    omni = ns.omni_model_config.OmniModelConfig.from_vllm_model_config(
        model_config,
        stage_id=1,
        model_stage="code2wav",
        model_arch="Qwen3TTSCode2Wav",
        worker_type="generation",
        async_chunk=async_chunk,
        stage_connector_config={"name": "SharedMemoryConnector", "extra": dict(_CONNECTOR_EXTRA)},
    )
    return VllmConfig(model_config=omni)


def build_stage(*, async_chunk: bool) -> torch.nn.Module:
    """The real ``Qwen3TTSCode2Wav`` on the CPU with its weights loaded by its
    own ``load_weights`` (random weights, seeded). ``load_weights`` also reads
    the connector's chunk sizes onto the decoder and, off CUDA, makes no
    CUDA-graph wrapper: this is the stage exactly as a CPU (or eager)
    deployment has it."""
    from vllm.config import set_current_vllm_config

    ns = _modules()
    vllm_config = _vllm_config(async_chunk)
    weights = _model_dir() / "speech_tokenizer" / "model.safetensors"
    with set_current_vllm_config(vllm_config):
        torch.manual_seed(0)
        stage = ns.stage.Qwen3TTSCode2Wav(vllm_config=vllm_config)
        if not weights.is_file():
            from safetensors.torch import save_file

            state = {f"decoder.{k}": v.contiguous() for k, v in stage.decoder.state_dict().items()}
            save_file(state, str(weights))
        stage.load_weights(iter(()))
    return stage


def attach_graph_wrapper(stage: torch.nn.Module) -> Any:
    """Construct vLLM-Omni's real ``CUDAGraphDecoderWrapper`` on the CPU with
    the arguments ``enable_cudagraph`` passes (read from the stage and the
    decoder as ``load_weights`` left them), and attach it as
    ``enable_cudagraph`` does, without ``warmup``: nothing is captured, and
    ``_cudagraph_enabled`` stays False, so decoding stays on the eager path
    while the decoder declares what a CUDA deployment declares."""
    ns = _modules()
    decoder = stage.decoder
    wrapper = ns.wrapper.CUDAGraphDecoderWrapper(
        decoder=decoder,
        capture_modes=stage.decoder_cudagraph_modes,
        capture_batch_sizes=None,
        stateless_capture_sizes=None,
        num_quantizers=decoder.config.num_quantizers,
        enabled=True,
        async_chunk=stage._async_chunk,
        initial_chunk_frames=decoder._initial_codec_chunk_frames,
        codec_chunk_frames=decoder._incremental_chunk_frames,
        codec_chunk_ramp=decoder._incremental_chunk_ramp or None,
        decode_chunk_size=stage._decode_chunk_frames,
        decode_left_context=stage._decode_left_context_frames,
    )
    decoder._cudagraph_wrapper = wrapper
    return wrapper


# --------------------------------------------------------------------------
# Observing the working copy


@dataclass
class InvocationEvent:
    """One ``pre_transformer`` call that ran on a working copy."""

    phase: str
    """The decoder method that made the copy (``_decode_suffix``, ...)."""
    rows: int
    working_copy_bytes: int
    working_copy_view_positions: int
    other_invocation_bytes: int
    """Other caches alive only for this call: the batched concatenation of the
    request caches (``_decode_suffix`` on the batched path) or the batched
    prefix cache (``_decode_icl_first_chunk`` on the batched path)."""
    caches: dict[str, Any] = field(repr=False, default_factory=dict)


class InvocationProbe:
    """Forward hook on ``decoder.pre_transformer`` that measures the working
    copy right after the call has written into it (its largest size).

    Why a frame walk: the working copy is a local variable
    (``working_cache``) of the decoder method that deep-copied it, and the
    batched copy of the request caches is in that method's ``caches`` dict;
    reading the caller's frame finds both without touching vLLM-Omni's code.
    A cache counts as a working copy only if it *is* that method's
    ``working_cache``; the batched copy counts only if its ``caches`` dict is
    not one of the stage's per-request states (then it is the retained cache).
    """

    _PHASES = ("_decode_icl_first_chunk", "_decode_xvec_first_chunk", "_decode_suffix")

    def __init__(self, stage: torch.nn.Module, *, keep_peak: bool = False) -> None:
        decoder_cls = type(stage.decoder)
        self._codes = {getattr(decoder_cls, name).__code__: name for name in self._PHASES}
        self._states = stage._decoder_state_cache
        self._keep_peak = keep_peak
        self.events: list[InvocationEvent] = []
        self.calls_with_cache = 0
        self.calls_without_cache = 0
        self._handle = stage.decoder.pre_transformer.register_forward_hook(self._hook, with_kwargs=True)

    def remove(self) -> None:
        self._handle.remove()

    def _caller(self) -> types.FrameType | None:
        frame = sys._getframe(2)
        for _ in range(12):
            if frame is None:
                return None
            if frame.f_code in self._codes:
                return frame
            frame = frame.f_back
        return None

    def _is_request_state(self, value: Any) -> bool:
        return any(value is state for state in self._states.values())

    def _hook(self, module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        cache = kwargs.get("past_key_values")
        if cache is None:
            cache = getattr(output, "past_key_values", None)
        if cache is None:
            self.calls_without_cache += 1
            return
        self.calls_with_cache += 1
        frame = self._caller()
        if frame is None or frame.f_locals.get("working_cache") is not cache:
            return  # the prefix pass that builds the cache the request keeps
        phase = self._codes[frame.f_code]
        local = frame.f_locals
        others: dict[str, Any] = {}
        if phase == "_decode_icl_first_chunk":
            prefix = local.get("prefix_cache")
            if prefix is not None and not self._is_request_state(local.get("caches")):
                others["batched_prefix_kv"] = prefix
        elif phase == "_decode_suffix":
            caches = local.get("caches")
            if isinstance(caches, dict) and not self._is_request_state(caches):
                others["batched_request_kv"] = caches.get("past_key_values")
        layers = cache_breakdown(cache)
        rows = layers[0].batch or 0
        event = InvocationEvent(
            phase=phase,
            rows=rows,
            working_copy_bytes=sum(layer.bytes for layer in layers),
            working_copy_view_positions=layers[0].positions,
            other_invocation_bytes=sum(measure_cache_bytes(c) for c in others.values() if c is not None),
        )
        if self._keep_peak:
            event.caches = {"working_copy": cache, **others}
        self.events.append(event)

    def peak(self) -> InvocationEvent | None:
        """The event with the most invocation bytes per row (latest on a tie)."""
        best: InvocationEvent | None = None
        for event in self.events:
            per_row = (event.working_copy_bytes + event.other_invocation_bytes) // max(event.rows, 1)
            if best is None or per_row >= (best.working_copy_bytes + best.other_invocation_bytes) // max(best.rows, 1):
                best = event
        return best


# --------------------------------------------------------------------------
# Driving requests through Qwen3TTSCode2Wav.forward


@dataclass(frozen=True)
class Request:
    """One request's chunks as the talker's connector emits them: the first
    chunk carries ``ref_frames`` reference frames (ICL) before its
    ``chunks[0]`` new frames; later chunks carry new frames only."""

    request_id: str
    ref_frames: int
    chunks: tuple[int, ...]


BATCHED = (
    Request("icl-a", WINDOW, (FIRST_CHUNK_FRAMES,) + (CHUNK_FRAMES,) * 5),
    Request("icl-b", WINDOW, (FIRST_CHUNK_FRAMES,) + (CHUNK_FRAMES,) * 5),
)
"""Two ICL requests with a full-window reference and the deploy file's chunk
sizes: every step groups them on the batched eager path. Five later chunks
reach the rolling steady state (the fourth is the first rolling one)."""

FALLBACK = (Request("icl-c", WINDOW, (3,) + (CHUNK_FRAMES,) * 5),)
"""One ICL request whose first chunk has 3 new frames instead of the
configured 1 (a per-request first-chunk size): the batched first-chunk path
declines it and the single-request fallback (``chunked_decode``) builds its
cache."""

XVEC = (Request("xvec-d", 0, (FIRST_CHUNK_FRAMES,) + (CHUNK_FRAMES,) * 5),)
"""One x-vector request (no reference prefix)."""

LONG_REFERENCE = (Request("icl-long", 100, (FIRST_CHUNK_FRAMES,) + (CHUNK_FRAMES,) * 5),)
"""One ICL request with a 100-frame reference, longer than the window: what
reaches the stage when ``codec_left_context_frames`` (or
``ref_code_context_frames``), which bounds the reference upstream, is set
above 72. The batched first-chunk path declines a prefix longer than the
window, so the fallback builds the cache from all 100 frames."""

CAPPED = tuple(Request(f"icl-{i}", WINDOW, (FIRST_CHUNK_FRAMES,) + (CHUNK_FRAMES,) * 5) for i in range(6))
"""Six batched ICL requests: more than ``decode_batch_max_size`` (4), so each
phase runs as a group of 4 and a group of 2, one after the other."""


def _codes(generator: torch.Generator, frames: int) -> torch.Tensor:
    """Random codec ids, [quantizers, frames]: the decoder's weights are random too."""
    return torch.randint(0, CODEBOOK_SIZE, (NUM_QUANTIZERS, frames), generator=generator)


def drive(stage: torch.nn.Module, requests: Iterable[Request], *, finish: bool = False) -> list[list[int]]:
    """Run every request's chunks through ``stage.forward``, one step per
    chunk index, all requests of a step in one call, as the runner batches
    them. Returns the audio sample count per request per step. With
    ``finish``, ends every request through ``on_requests_finished`` (the
    runner's hook; the stage drops their state)."""
    requests = list(requests)
    generator = torch.Generator().manual_seed(1)
    steps = max(len(r.chunks) for r in requests)
    samples: list[list[int]] = []
    for step in range(steps):
        active = [r for r in requests if step < len(r.chunks)]
        ids: list[torch.Tensor] = []
        infos: list[dict[str, Any]] = []
        for request in active:
            frames = request.chunks[step]
            meta: dict[str, Any] = {"request_id": request.request_id, "finished": False}
            if step == 0 and request.ref_frames:
                frames += request.ref_frames
                meta.update(
                    ref_context_size=request.ref_frames,
                    ref_context_request_id=request.request_id,
                    ref_context_included=True,
                    left_context_size=request.ref_frames,
                )
            ids.append(_codes(generator, frames).reshape(-1))
            infos.append({"meta": meta})
        output = stage.forward(
            input_ids=torch.cat(ids),
            runtime_additional_information=infos,
            seq_token_counts=[int(x.numel()) for x in ids],
            request_ids=[r.request_id for r in active],
        )
        samples.append([int(w.numel()) for w in output.multimodal_outputs["model_outputs"]])
    if finish:
        stage.on_requests_finished([r.request_id for r in requests])
    return samples


def _drive_stateless(stage: torch.nn.Module) -> list[int]:
    """Two whole utterances (100 and 60 frames) through the stateless path
    (``async_chunk`` off: ``batched_chunked_decode`` with ``caches=None``)."""
    generator = torch.Generator().manual_seed(2)
    ids = [_codes(generator, frames).reshape(-1) for frames in (100, 60)]
    output = stage.forward(
        input_ids=torch.cat(ids),
        runtime_additional_information=[{"meta": {"request_id": f"s{i}", "left_context_size": 0}} for i in range(2)],
        seq_token_counts=[int(x.numel()) for x in ids],
        request_ids=["s0", "s1"],
    )
    return [int(w.numel()) for w in output.multimodal_outputs["model_outputs"]]


# --------------------------------------------------------------------------
# Audit targets (``kv-budget audit peers.vllm_omni.qwen3_tts:NAME``)


def async_chunk_eager() -> torch.nn.Module:
    """The stage as a CPU or ``enforce_eager`` deployment has it (no CUDA-graph
    wrapper), after two batched ICL requests ran six chunks each. Why: this is
    the path that declares nothing while it holds one cache per request."""
    stage = build_stage(async_chunk=True)
    drive(stage, BATCHED)
    return stage


def async_chunk_declared() -> torch.nn.Module:
    """Same run as :func:`async_chunk_eager` with vLLM-Omni's real
    CUDA-graph wrapper attached (not warmed up), so the decoder declares
    ``codec_decoder_request`` and ``codec_decoder_working_copy`` as a CUDA
    deployment does. At rest only the retained caches are live."""
    stage = build_stage(async_chunk=True)
    attach_graph_wrapper(stage)
    drive(stage, BATCHED)
    return stage


def async_chunk_declared_at_peak() -> torch.nn.Module:
    """:func:`async_chunk_declared`, plus a reference to the invocation caches
    of the step whose per-row invocation bytes were largest (working copy
    and batched copy of the request caches), kept in the stage attribute
    ``kv_budget_invocation_peak``. Why: the audit only sees what is held, and
    the working copy is otherwise gone when the call returns. The cache
    objects are not modified after that call, so they hold what they held
    at their peak."""
    stage = build_stage(async_chunk=True)
    attach_graph_wrapper(stage)
    probe = InvocationProbe(stage, keep_peak=True)
    try:
        drive(stage, BATCHED)
    finally:
        probe.remove()
    peak = probe.peak()
    stage.kv_budget_invocation_peak = dict(peak.caches) if peak else {}
    return stage


def async_chunk_fallback_declared() -> torch.nn.Module:
    """Declared stage (wrapper attached) after one ICL request whose first
    chunk took the single-request fallback. Why: that path keeps the
    prefill's ``torch.cat`` storage (``window`` positions) behind the
    ``window - 1`` view, one position more than declared."""
    stage = build_stage(async_chunk=True)
    attach_graph_wrapper(stage)
    drive(stage, FALLBACK)
    return stage


def stateless() -> torch.nn.Module:
    """The stage with ``async_chunk`` off after two utterances: the decoder
    runs ``_forward_exact`` without a cache. Declares nothing, holds nothing."""
    stage = build_stage(async_chunk=False)
    _drive_stateless(stage)
    return stage


def stateless_declared() -> torch.nn.Module:
    """:func:`stateless` with the real wrapper attached in stateless mode:
    still declares nothing (no async chunk, nothing captured)."""
    stage = build_stage(async_chunk=False)
    attach_graph_wrapper(stage)
    _drive_stateless(stage)
    return stage


# --------------------------------------------------------------------------
# Figures for the docs and tests


def _retained(stage: torch.nn.Module) -> dict[str, dict[str, int]]:
    """Storage bytes, rows and view length of each request's retained cache."""
    out: dict[str, dict[str, int]] = {}
    for request_id, state in stage._decoder_state_cache.items():
        layers = cache_breakdown(state["past_key_values"])
        out[request_id] = {
            "rows": layers[0].batch or 0,
            "bytes": sum(layer.bytes for layer in layers),
            "view_positions": layers[0].positions,
        }
    return out


def _scenario(requests: tuple[Request, ...]) -> dict[str, Any]:
    """One declared stage driven through ``requests``: retained caches at
    rest, every working copy, the peaks, and that finishing frees them."""
    per_position = bytes_per_position_row()
    stage = build_stage(async_chunk=True)
    attach_graph_wrapper(stage)
    probe = InvocationProbe(stage)
    try:
        drive(stage, requests)
    finally:
        probe.remove()
    retained = _retained(stage)
    events = [
        {
            "phase": e.phase,
            "rows": e.rows,
            "working_copy_bytes": e.working_copy_bytes,
            "working_copy_positions_per_row": e.working_copy_bytes // (per_position * e.rows),
            "working_copy_view_positions": e.working_copy_view_positions,
            "other_invocation_bytes": e.other_invocation_bytes,
            "other_invocation_positions_per_row": e.other_invocation_bytes // (per_position * e.rows),
        }
        for e in probe.events
    ]
    peak = max(events, key=lambda e: e["working_copy_positions_per_row"])
    total = max(events, key=lambda e: e["working_copy_positions_per_row"] + e["other_invocation_positions_per_row"])
    stage.on_requests_finished([r.request_id for r in requests])
    return {
        "retained": {
            rid: dict(v, positions_per_row=v["bytes"] // (per_position * v["rows"]) if v["rows"] else 0)
            for rid, v in retained.items()
        },
        "working_copy_steps": events,
        "working_copy_peak_positions_per_row": peak["working_copy_positions_per_row"],
        "working_copy_peak_bytes_per_row": peak["working_copy_bytes"] // peak["rows"],
        "invocation_peak_positions_per_row": total["working_copy_positions_per_row"]
        + total["other_invocation_positions_per_row"],
        "invocation_peak_bytes_per_row": (total["working_copy_bytes"] + total["other_invocation_bytes"])
        // total["rows"],
        "held_after_finish": len(stage._decoder_state_cache),
        "invocation_rows_max": max(e["rows"] for e in events),
    }


def _declared(stage: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """The decoder's own declarations, as plain values for JSON."""
    return {
        spec.name: {
            "physical_capacity_positions": spec.physical_capacity_positions,
            "bytes_per_row": spec.bytes_per_row,
            "scope": getattr(spec.scope, "value", spec.scope),
            "rows": getattr(spec.rows, "value", spec.rows),
        }
        for spec in stage.decoder.model_local_kv_specs()
    }


def measure() -> dict[str, Any]:
    """The figures ``docs/vllm-omni-qwen3-tts.md`` quotes, every one measured on
    vLLM-Omni's own code: declarations with and without the wrapper, bytes
    and positions per row the per-request caches hold (batched path,
    single-request fallback, x-vector), the working copy per step and at its
    peak, and what the stateless path holds. Positions are storage bytes
    divided by :func:`bytes_per_position_row`."""
    eager = build_stage(async_chunk=True)
    eager_declared = _declared(eager)
    stateless_stage = build_stage(async_chunk=False)
    probe = InvocationProbe(stateless_stage)
    try:
        _drive_stateless(stateless_stage)
    finally:
        probe.remove()
    declared_stage = build_stage(async_chunk=True)
    attach_graph_wrapper(declared_stage)
    return {
        "geometry": {
            "window": WINDOW,
            "layers": LAYERS,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "dtype": str(DTYPE),
            "bytes_per_position_row": bytes_per_position_row(),
        },
        "declared_with_wrapper": _declared(declared_stage),
        "declared_without_wrapper": eager_declared,
        "stateless": {
            "declared": _declared(stateless_stage),
            "pre_transformer_calls_with_cache": probe.calls_with_cache,
            "pre_transformer_calls_without_cache": probe.calls_without_cache,
            "held_caches": len(stateless_stage._decoder_state_cache),
        },
        "batched": _scenario(BATCHED),
        "fallback": _scenario(FALLBACK),
        "xvec": _scenario(XVEC),
        "long_reference": _scenario(LONG_REFERENCE),
        "capped": _scenario(CAPPED),
    }


def watch_in_step(*, declared: bool, requests: tuple[Request, ...] = BATCHED) -> dict[str, Any]:
    """Drive ``requests`` with kv-budget's own in-step tracker watching, as
    a serving engine watches a sampled step: :class:`InStepTracker` fed by
    the engine glue's ``Cache.update`` hook (``vllm_patches.cache_updates``).
    With ``declared`` the real wrapper is attached, so the decoder declares;
    without it nothing declares (the eager path).

    At every working copy (right after ``pre_transformer`` wrote into it, an
    :class:`InvocationProbe` event) the tracker's running count is recorded
    beside this module's own count of the caches alive then: the working
    copy, the batched copy of the request caches, and every request's
    retained cache (``cache_breakdown``, one ``seen`` set). Returns those
    moments and the window's peaks."""
    from kv_budget.sample.in_step import InStepTracker
    from vllm_patches import cache_updates

    problem = cache_updates.install()
    if problem is not None:
        raise RuntimeError(f"in-step tracking unavailable: {problem}")
    stage = build_stage(async_chunk=True)
    if declared:
        attach_graph_wrapper(stage)
    tracker = InStepTracker(stage, ["decoder"] if declared else [])
    probe = InvocationProbe(stage)
    moments: list[dict[str, Any]] = []

    def at_working_copy(module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        if len(probe.events) == len(moments):
            return  # not a working copy: the prefix pass that builds a request's cache
        event = probe.events[-1]
        seen: set = set()
        retained = sum(
            layer.bytes for state in stage._decoder_state_cache.values() if state.get("past_key_values") is not None
            for layer in cache_breakdown(state["past_key_values"], seen=seen))
        moments.append({
            "phase": event.phase,
            "rows": event.rows,
            "working_copy_bytes": event.working_copy_bytes,
            "invocation_bytes": event.working_copy_bytes + event.other_invocation_bytes,
            "retained_bytes": retained,
            "tracked": tracker.held_now(),
        })

    handle = stage.decoder.pre_transformer.register_forward_hook(at_working_copy, with_kwargs=True)
    try:
        with cache_updates.tracking(tracker):
            drive(stage, requests)
    finally:
        handle.remove()
        probe.remove()
    return {"moments": moments, "peaks": tracker.end().model_dump(), "stage": stage}


def _main() -> int:
    """``python -m peers.vllm_omni.qwen3_tts``: print :func:`measure` as JSON,
    the source of every figure in ``docs/vllm-omni-qwen3-tts.md``."""
    print(json.dumps(measure(), indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
