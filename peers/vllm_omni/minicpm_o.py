"""vLLM-Omni 0.30.0's MiniCPM-o 4.5 streaming Whisper encoder, built and run on the CPU for the audit.

Why: in duplex mode MiniCPM-o 4.5's stage 0 keeps, per streaming session, the
self-attention KV of its Whisper audio encoder (an ``EncoderDecoderCache``)
outside vLLM's paged pool. vLLM-Omni declares it on the encoder
(``MiniCPMWhisperEncoder.model_local_kv_specs``: ``whisper_encoder_self_attn``,
session scope, a fixed one row, ``embed_positions`` rows as positions), while
its default deploy file allows four sessions at once. Whether the declaration
matches what is held can only be answered by running vLLM-Omni's own code, so
everything here builds and drives the real objects:

* the thinker ``MiniCPMO45OmniLLMForConditionalGeneration``
  (``minicpmo_4_5/minicpmo_4_5_omni_llm.py``), built by its own ``__init__``
  from a real ``VllmConfig`` whose hf config is vLLM-Omni's ``MiniCPMOConfig``
  (a small LLM, no vision, a small ``WhisperConfig``). It builds its vLLM
  LLM, its Whisper encoder ``apm`` (the declarer), the audio projection and
  pooling itself;
* the duplex session runtime ``MiniCPMO45Stage0DuplexRuntime``
  (``minicpmo_4_5/duplex/stage0.py``) with its session states
  (``_MiniCPMO45Stage0SessionState``) in ``runtime.sessions``, created the
  way the stage model creates them. Each audio chunk goes through the
  runtime's ``_stage_audio_embeddings`` with the attributes its prefill loop
  sets (``chunk_idx``, ``use_extra_context``, 0 or 2 prefix and 2 suffix
  extra frames): it swaps the session's ``audio_past_key_values`` onto the
  thinker, runs ``get_audio_embedding_streaming`` (which resets a cache
  that would reach ``embed_positions`` and runs the encoder with
  ``use_cache=True``) and stores the cache back on the session.

What is not vLLM-Omni's here:

* One import-time alias. The module calls ``AutoImageProcessor.register`` at
  import, and transformers 5.14's top-level ``AutoImageProcessor`` is a
  placeholder that raises ``ImportError`` ("requires the Torchvision
  library") when torchvision is not installed. No torchvision works with
  the CPU torch here (the registry's 0.28 wheel links ``libtorch_cuda.so``
  and ``libcudart.so.13``), so before the import the top-level name is
  pointed at transformers' own class from
  ``transformers.models.auto.image_processing_auto`` (which needs only PIL).
  Nothing image-related runs.
* The registration of ``MiniCPMOConfig`` with ``AutoConfig`` (a checkpoint
  brings its config as remote code); the ``config.json`` names vLLM's own
  ``MiniCPMO`` architecture only so vLLM's ``ModelConfig`` makes a
  multimodal config; the thinker is built directly, as
  ``init_vllm_registered_model`` would.
* The stage model: a ``ModuleDict`` whose only child is named ``thinker``
  (so owner paths read ``thinker.apm`` as in a deployment), holding the
  runtime as ``_minicpmo45_duplex_data_plane_helper`` as the real stage
  model does. The remote-code audio processor (not in the wheel) is replaced
  by log-mel features computed with transformers' ``WhisperFeatureExtractor``
  from a synthetic signal, cut into chunks of 10 frames (5 encoder
  positions) plus the 2-frame context the runtime asks to trim.

The caches stay where vLLM-Omni keeps them: on the session states in the
runtime's ``sessions`` dict. ``kv-budget audit`` finds them there (it
searches plain objects' attributes three levels deep) and attributes them to
the declaring encoder below the stage.

Geometry: 2 encoder layers, 4 heads of 8, bfloat16, ``max_source_positions``
30; a chunk adds 5 positions, so a session is full at 25 positions (the next
chunk would reach 30 and resets it), as 1 s chunks (50 positions) fill the
published 1500 to 1450.
"""

from __future__ import annotations

import importlib
import json
import sys
from typing import Any

import numpy as np
import torch

from kv_budget.collect.model import collect_model_local_kv_specs
from kv_budget.sample.caches import measure_cache_bytes
from peers.vllm_omni.files import import_omni_module, omni_root
from peers.vllm_omni.vllm_setup import built_under, finish_loading, vllm_cpu_config

__all__ = [
    "MODULE",
    "RUNTIME_MODULE",
    "OWNER",
    "DECLARATION",
    "ENCODER_LAYERS",
    "HEADS",
    "HEAD_DIM",
    "MAX_SOURCE_POSITIONS",
    "CHUNK_POSITIONS",
    "CHUNKS_TO_FULL",
    "FULL_POSITIONS",
    "deploy_max_sessions",
    "build_stage",
    "open_session",
    "stream_chunk",
    "streaming_sessions",
    "streaming_one_session",
    "streaming_four_sessions",
    "measure",
]

MODULE = "vllm_omni.model_executor.models.minicpmo_4_5.minicpmo_4_5_omni_llm"
RUNTIME_MODULE = "vllm_omni.model_executor.models.minicpmo_4_5.duplex.stage0"

DTYPE = torch.bfloat16
"""The thinker's dtype, as its checkpoint config (``torch_dtype``) says."""

OWNER = "thinker.apm"
"""The declaring encoder's path: the stage model keeps the thinker as
``thinker`` and the thinker its Whisper encoder as ``apm``."""

DECLARATION = "whisper_encoder_self_attn"

ENCODER_LAYERS = 2
HEADS = 4
HEAD_DIM = 8
D_MODEL = HEADS * HEAD_DIM
MAX_SOURCE_POSITIONS = 30
N_MELS = 16
HOP = 160
SAMPLE_RATE = 16000

CHUNK_FRAMES = 10
"""Mel frames of new audio per chunk: 5 encoder positions after the
stride-2 convolution (1 s = 100 frames = 50 positions in production)."""
CONTEXT_FRAMES = 2
"""Extra frames on each side that the runtime asks the encoder to trim
(``prefix_extra_frames`` 2 after the first chunk, ``suffix_extra_frames`` 2)."""
CHUNK_POSITIONS = CHUNK_FRAMES // 2
CHUNKS_TO_FULL = (MAX_SOURCE_POSITIONS - 1) // CHUNK_POSITIONS
"""Chunks a session takes before the next one would reach
``embed_positions`` and reset it."""
FULL_POSITIONS = CHUNKS_TO_FULL * CHUNK_POSITIONS

_CONFIG = {
    "model_type": "minicpmo",
    "architectures": ["MiniCPMO"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "audio_pool_step": 2,
    "init_vision": False,
    "init_tts": False,
    "audio_config": {
        "d_model": D_MODEL,
        "encoder_layers": ENCODER_LAYERS,
        "encoder_attention_heads": HEADS,
        # The thinker's audio projection takes encoder_ffn_dim // 4 inputs
        # from the encoder's d_model outputs (whisper-medium: 4096 / 4 = 1024).
        "encoder_ffn_dim": 4 * D_MODEL,
        "num_mel_bins": N_MELS,
        "max_source_positions": MAX_SOURCE_POSITIONS,
        "decoder_layers": 1,
        "decoder_attention_heads": HEADS,
        "decoder_ffn_dim": 4 * D_MODEL,
    },
}

_state: dict[str, Any] = {}


def _modules() -> tuple[Any, Any]:
    """vLLM-Omni's model file and duplex runtime file, imported once (with
    the ``AutoImageProcessor`` alias of the module docstring), and its
    config class registered with ``AutoConfig``."""
    if "modules" in _state:
        return _state["modules"]
    importlib.import_module("transformers")
    if getattr(sys.modules["transformers"].AutoImageProcessor, "is_dummy", False):
        real = importlib.import_module("transformers.models.auto.image_processing_auto").AutoImageProcessor
        # Importing that submodule can put a new lazy ``transformers`` module
        # into sys.modules: alias on the one the next import will read.
        setattr(sys.modules["transformers"], "AutoImageProcessor", real)
    from transformers import AutoConfig

    model_file = import_omni_module(MODULE)
    runtime_file = import_omni_module(RUNTIME_MODULE)
    AutoConfig.register("minicpmo", model_file.MiniCPMOConfig, exist_ok=True)
    _state["modules"] = (model_file, runtime_file)
    return _state["modules"]


def deploy_max_sessions() -> dict[str, Any]:
    """What ``deploy/minicpmo_4_5.yaml`` in the wheel allows: the duplex
    session cap and each stage's ``max_num_seqs``."""
    import yaml

    path = omni_root() / "vllm_omni" / "deploy" / "minicpmo_4_5.yaml"
    data = yaml.safe_load(path.read_text())
    return {
        "file": "vllm_omni/deploy/minicpmo_4_5.yaml",
        "session_mode": data.get("session_mode"),
        "max_sessions": data["duplex_session"]["max_sessions"],
        "stage_max_num_seqs": [stage.get("max_num_seqs") for stage in data["stages"]],
    }


def build_stage() -> torch.nn.Module:
    """A stage holding vLLM-Omni's thinker (built by its own ``__init__``,
    random weights, seeded) and its duplex runtime, with no session yet."""
    model_file, runtime_file = _modules()
    vllm_config = vllm_cpu_config(_CONFIG, DTYPE, limit_mm_per_prompt={"image": 0, "video": 0, "audio": 1})
    with built_under(vllm_config):
        torch.manual_seed(0)
        thinker = model_file.MiniCPMO45OmniLLMForConditionalGeneration(vllm_config=vllm_config, prefix="thinker")
    stage = torch.nn.ModuleDict({"thinker": finish_loading(thinker, vllm_config)})
    stage._minicpmo45_duplex_data_plane_helper = runtime_file.MiniCPMO45Stage0DuplexRuntime(
        stage, model_path=None, device="cpu"
    )
    return stage


def _runtime(stage: torch.nn.Module) -> Any:
    return stage._minicpmo45_duplex_data_plane_helper


def open_session(stage: torch.nn.Module, session_id: str) -> Any:
    """A new session state in the runtime, made as the stage model makes it
    on a session's first payload (``minicpmo_4_5_omni.py``)."""
    _, runtime_file = _modules()
    runtime = _runtime(stage)
    state = runtime_file._MiniCPMO45Stage0SessionState(session_id=session_id)
    runtime.sessions[session_id] = state
    runtime.thinker.audio_past_key_values = None
    return state


def _signal(session_id: str, samples: int) -> np.ndarray:
    """A deterministic test signal per session: a chirp plus a little noise."""
    rng = np.random.default_rng(sum(map(ord, session_id)))
    t = np.arange(samples) / SAMPLE_RATE
    chirp = np.sin(2 * np.pi * (200 + 400 * t) * t)
    return (0.5 * chirp + 0.01 * rng.standard_normal(samples)).astype(np.float32)


def _mel_chunk(session_id: str, chunk_idx: int) -> torch.Tensor:
    """Log-mel frames of one chunk with its context frames, shape
    (1, mels, frames): the first chunk has only the 2 suffix frames."""
    from transformers import WhisperFeatureExtractor

    extractor = _state.get("extractor")
    if extractor is None:
        extractor = _state["extractor"] = WhisperFeatureExtractor(
            feature_size=N_MELS, sampling_rate=SAMPLE_RATE, hop_length=HOP, n_fft=400
        )
    prefix = 0 if chunk_idx == 0 else CONTEXT_FRAMES
    first = chunk_idx * CHUNK_FRAMES - prefix
    frames = prefix + CHUNK_FRAMES + CONTEXT_FRAMES
    signal = _signal(session_id, (chunk_idx + 2) * CHUNK_FRAMES * HOP)
    wave = signal[first * HOP : (first + frames) * HOP]
    features = extractor(wave, sampling_rate=SAMPLE_RATE, padding="longest", return_tensors="pt").input_features
    if features.shape[-1] != frames:
        raise RuntimeError(f"expected {frames} mel frames, got {features.shape[-1]}")
    return features


def stream_chunk(stage: torch.nn.Module, state: Any) -> int:
    """Feed the session's next chunk through the runtime as its prefill loop
    does, and return the positions the session's cache holds afterwards."""
    model_file, _ = _modules()
    chunk_idx = state.audio_chunk_idx
    mel = _mel_chunk(state.session_id, chunk_idx)
    feature = model_file.MiniCPMOBatchFeature(
        {"audio_features": mel, "audio_feature_lens": [torch.tensor([mel.shape[-1]])]}
    )
    for name, value in (
        ("chunk_idx", chunk_idx),
        ("use_extra_context", True),
        ("prefix_extra_frames", 0 if chunk_idx == 0 else CONTEXT_FRAMES),
        ("suffix_extra_frames", CONTEXT_FRAMES),
    ):
        setattr(feature, name, value)
    with torch.no_grad():
        embeds = _runtime(stage)._stage_audio_embeddings(feature, state=state)
    if embeds is None:
        raise RuntimeError(f"session {state.session_id}: chunk {chunk_idx} produced no audio embedding")
    state.audio_chunk_idx += 1
    return int(model_file._get_audio_cache_length(state.audio_past_key_values))


def streaming_sessions(count: int, chunks: int = CHUNKS_TO_FULL) -> torch.nn.Module:
    """A stage with ``count`` concurrent sessions, fed ``chunks`` chunks each
    in turn (default: until each cache is full)."""
    stage = build_stage()
    states = [open_session(stage, f"session-{i}") for i in range(count)]
    for _ in range(chunks):
        for state in states:
            stream_chunk(stage, state)
    return stage


def streaming_one_session() -> torch.nn.Module:
    """One session with a full cache: what the declaration (one row) covers."""
    return streaming_sessions(1)


def streaming_four_sessions() -> torch.nn.Module:
    """Four full sessions: what ``deploy/minicpmo_4_5.yaml`` allows."""
    return streaming_sessions(4)


def _production_declaration() -> dict[str, int]:
    """vLLM-Omni's declarer on a whisper-medium-sized encoder (24 layers,
    d_model 1024, 16 heads, 1500 positions, bfloat16; the geometry its
    ``MiniCPMOConfig`` comment names), built on the meta device: the
    figure a deployment declares, without allocating it."""
    from transformers import WhisperConfig

    model_file, _ = _modules()
    config = WhisperConfig(
        d_model=1024, encoder_layers=24, encoder_attention_heads=16, encoder_ffn_dim=4096, max_source_positions=1500
    )
    with torch.device("meta"):
        encoder = model_file.MiniCPMWhisperEncoder(config).to(DTYPE)
    (spec,) = collect_model_local_kv_specs(encoder).specs
    return {"positions": spec.spec.physical_capacity_positions, "bytes_per_session": spec.spec.bytes_per_row}


def _reset_step(stage: torch.nn.Module, state: Any) -> dict[str, int]:
    """Feed one more chunk to a full session and measure, inside the
    encoder call, what is alive: the runtime still holds the old cache on
    the session state while the encoder builds the new one."""
    apm = stage["thinker"].apm
    seen: dict[str, int] = {}

    def observe(_module: Any, _args: Any, kwargs: dict[str, Any], output: Any) -> None:
        old = state.audio_past_key_values
        new = output.past_key_values
        seen["input_cache_was_reset"] = int(kwargs.get("past_key_values") is None)
        seen["old_bytes"] = measure_cache_bytes(old)
        seen["new_bytes"] = measure_cache_bytes(new) if new is not old else 0

    handle = apm.register_forward_hook(observe, with_kwargs=True)
    try:
        seen["positions_after"] = stream_chunk(stage, state)
    finally:
        handle.remove()
    seen["peak_bytes"] = seen["old_bytes"] + seen["new_bytes"]
    return seen


def measure(sessions: int = 4) -> dict[str, Any]:
    """Declared versus held for ``sessions`` concurrent full sessions, in
    exact bytes, from vLLM-Omni's own declarer and streaming path, plus the
    reset step of one session and the deploy file's session cap."""
    stage = build_stage()
    collection = collect_model_local_kv_specs(stage)
    declared = {
        f"{owned.owner}/{owned.spec.name}": {
            "scope": owned.spec.scope.value,
            "rows": owned.spec.rows.value,
            "rows_fixed": owned.spec.rows_fixed,
            "positions": owned.spec.physical_capacity_positions,
            "bytes_per_row": owned.spec.bytes_per_row,
        }
        for owned in collection.specs
    }
    states = [open_session(stage, f"session-{i}") for i in range(sessions)]
    positions: dict[str, list[int]] = {state.session_id: [] for state in states}
    for _ in range(CHUNKS_TO_FULL):
        for state in states:
            positions[state.session_id].append(stream_chunk(stage, state))
    held = {state.session_id: measure_cache_bytes(state.audio_past_key_values) for state in states}
    thinker_holds = stage["thinker"].audio_past_key_values
    reset = _reset_step(stage, states[0])
    return {
        "declared": declared,
        "sessions": sessions,
        "positions_after_each_chunk": positions,
        "held_bytes_per_session": held,
        "held_bytes_total": sum(held.values()),
        "thinker_holds_between_calls": None if thinker_holds is None else type(thinker_holds).__name__,
        "reset_step": reset,
        "deploy": deploy_max_sessions(),
        "production": _production_declaration(),
    }


if __name__ == "__main__":  # pragma: no cover - a manual look at the figures
    print(json.dumps(measure(), indent=2))
