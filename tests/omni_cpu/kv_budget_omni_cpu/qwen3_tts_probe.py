"""Test support: an independent count of the caches vLLM-Omni's Qwen3-TTS
code2wav stage holds while it serves, and the wrapper that makes its
decoder declare them off CUDA.

Not vLLM-Omni code and not part of kv-budget: it observes vLLM-Omni's own
stage model (``Qwen3TTSCode2Wav``) in the stage's engine-core process and
changes nothing it computes. Both are switched on by environment variables
the test sets for the API server (the stage processes inherit them), and
installed by :func:`kv_budget_omni_cpu.register` (a ``vllm.general_plugins``
entry point, so they are in place before the stage loads its model).

**The count** (:data:`PROBE_ENV`, a directory). What it replaces: nothing;
it is the test's own measurement, against which kv-budget's figures are
checked, so it shares no code with kv-budget. It counts storages with plain
torch (``untyped_storage().nbytes()``, each storage once, keys and values
of every layer of every ``DynamicCache``), at two moments:

* after every ``forward`` of the stage: the caches kept between steps, in
  ``_decoder_state_cache`` (``past_key_values`` of each request's state);
* inside every decoder call that runs on a working copy (a forward hook on
  ``decoder.pre_transformer``, after it wrote into the copy: its largest
  size): every cache the decoder's frames on the stack hold (the working
  copy, the batched copy of the request caches) plus the kept ones.

It writes ``tts-probe-<pid>.json`` after each forward: the peaks, the most
requests kept at once, and per-row figures (bytes of one retained row, of
one working-copy row, of everything a decoder call holds beside the kept
caches per row of its working copy) with the positions they hold.

**The declaring wrapper** (:data:`DECLARE_ENV` = ``1``). What it replaces:
vLLM-Omni's ``Qwen3TTSCode2Wav.load_weights`` calls
``decoder.enable_cudagraph`` only on CUDA, and the decoder declares its
per-request caches only when that wrapper exists. Why: to run the declared
regime (what a CUDA deployment plans from) on this machine. How: after
vLLM-Omni's own ``load_weights`` returns, vLLM-Omni's real
``CUDAGraphDecoderWrapper`` is constructed with the arguments
``enable_cudagraph`` passes and attached as it attaches it, without
``warmup``: nothing is captured, ``_cudagraph_enabled`` stays False, decoding
stays on the eager path, and the decoder's own ``model_local_kv_specs``
reports what it reports on CUDA (``peers.vllm_omni.qwen3_tts`` does the same
for the audit).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

PROBE_ENV = "KV_BUDGET_TTS_PROBE_DIR"
DECLARE_ENV = "KV_BUDGET_TTS_DECLARE"

_FRAME_DEPTH = 16
"""Frames above ``pre_transformer`` searched for the decoder's own: its
batched and single-request decode paths nest about six deep."""


def _storages(cache: Any, seen: set[int]) -> tuple[int, int]:
    """(new bytes, positions of its first layer's keys view) of one cache."""
    new = 0
    positions = 0
    for index, layer in enumerate(getattr(cache, "layers", ()) or ()):
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if tensor is None or not hasattr(tensor, "untyped_storage") or tensor.numel() == 0:
                continue
            storage = tensor.untyped_storage()
            if storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            new += storage.nbytes()
            if index == 0 and name == "keys" and tensor.dim() == 4:
                positions = int(tensor.shape[-2])
    return new, positions


def _caches_in(value: Any, depth: int = 2) -> list[Any]:
    from transformers.cache_utils import DynamicCache

    if isinstance(value, DynamicCache):
        return [value]
    if depth <= 0:
        return []
    if isinstance(value, dict):
        return [c for item in value.values() for c in _caches_in(item, depth - 1)]
    if isinstance(value, (list, tuple)):
        return [c for item in value for c in _caches_in(item, depth - 1)]
    return []


class _Count:
    """The figures of one stage model, rewritten to the probe file."""

    def __init__(self, stage: Any, directory: str) -> None:
        self.stage = stage
        self.path = Path(directory) / f"tts-probe-{os.getpid()}.json"
        self.decoder_files = {type(stage.decoder).__init__.__code__.co_filename}
        self.figures = {
            "forwards": 0, "working_copies": 0,
            "retained_peak_bytes": 0, "retained_peak_entries": 0, "entries_peak": 0,
            "at_once_peak_bytes": 0, "at_once_peak_retained_bytes": 0, "at_once_peak_invocation_bytes": 0,
            "retained_row_bytes": [], "working_copy_row_bytes": [], "working_copy_rows_max": 0,
            "retained_row_positions": [], "working_copy_row_positions": [],
            "at_once_invocation_row_bytes": [],
        }
        stage.decoder.pre_transformer.register_forward_hook(self.at_working_copy, with_kwargs=True)

    def retained(self, seen: set[int]) -> int:
        total = 0
        for state in list(self.stage._decoder_state_cache.values()):
            cache = state.get("past_key_values") if isinstance(state, dict) else None
            if cache is None:
                continue
            size, positions = _storages(cache, seen)
            total += size
            rows = int(cache.layers[0].keys.shape[0]) if size and cache.layers[0].keys.dim() == 4 else 0
            if rows == 1:
                self._add("retained_row_bytes", size)
                self._add("retained_row_positions", positions)
        return total

    def _add(self, key: str, value: int) -> None:
        if value not in self.figures[key]:
            self.figures[key].append(value)

    def after_forward(self) -> None:
        f = self.figures
        f["forwards"] += 1
        entries = len(self.stage._decoder_state_cache)
        retained = self.retained(set())
        f["entries_peak"] = max(f["entries_peak"], entries)
        if retained > f["retained_peak_bytes"]:
            f["retained_peak_bytes"], f["retained_peak_entries"] = retained, entries
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(f))
        tmp.replace(self.path)

    def at_working_copy(self, module: Any, args: Any, kwargs: dict, output: Any) -> None:
        working = kwargs.get("past_key_values")
        if working is None:
            return
        seen: set[int] = set()
        invocation = 0
        frame = sys._getframe(1)
        for _ in range(_FRAME_DEPTH):
            if frame is None:
                break
            if frame.f_code.co_filename in self.decoder_files:
                for name, value in frame.f_locals.items():
                    if name == "self":
                        continue
                    for cache in _caches_in(value):
                        if not any(cache is s.get("past_key_values") for s in self.stage._decoder_state_cache.values()
                                   if isinstance(s, dict)):
                            invocation += _storages(cache, seen)[0]
            frame = frame.f_back
        copy_seen: set[int] = set()
        copy_bytes, copy_positions = _storages(working, copy_seen)
        rows = int(working.layers[0].keys.shape[0]) if working.layers and working.layers[0].keys.dim() == 4 else 0
        f = self.figures
        f["working_copies"] += 1
        f["working_copy_rows_max"] = max(f["working_copy_rows_max"], rows)
        if rows:
            self._add("working_copy_row_bytes", copy_bytes // rows)
            self._add("working_copy_row_positions", copy_positions)
        if rows:
            self._add("at_once_invocation_row_bytes", invocation // rows)
        retained = self.retained(seen)
        if retained + invocation > f["at_once_peak_bytes"]:
            f["at_once_peak_bytes"] = retained + invocation
            f["at_once_peak_retained_bytes"], f["at_once_peak_invocation_bytes"] = retained, invocation


def _wrap_forward(cls: Any, directory: str) -> None:
    original = cls.forward
    counts: dict[int, _Count] = {}

    def forward(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        count = counts.get(id(self))
        if count is None:
            count = counts[id(self)] = _Count(self, directory)
        count.after_forward()
        return result

    cls.forward = forward


def _wrap_load_weights(cls: Any) -> None:
    from vllm_omni.model_executor.models.qwen3_tts.segmented_graph_wrapper import CUDAGraphDecoderWrapper

    original = cls.load_weights

    def load_weights(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        decoder = self.decoder
        if getattr(decoder, "_cudagraph_wrapper", None) is None:
            decoder._cudagraph_wrapper = CUDAGraphDecoderWrapper(
                decoder=decoder,
                capture_modes=self.decoder_cudagraph_modes,
                capture_batch_sizes=None,
                stateless_capture_sizes=None,
                num_quantizers=decoder.config.num_quantizers,
                enabled=True,
                async_chunk=self._async_chunk,
                initial_chunk_frames=decoder._initial_codec_chunk_frames,
                codec_chunk_frames=decoder._incremental_chunk_frames,
                codec_chunk_ramp=decoder._incremental_chunk_ramp or None,
                decode_chunk_size=self._decode_chunk_frames,
                decode_left_context=self._decode_left_context_frames,
            )
        return result

    cls.load_weights = load_weights


_installed = False


def install() -> None:
    """Both shims, where their variables ask for them (once per process)."""
    global _installed
    if _installed or not (os.environ.get(PROBE_ENV) or os.environ.get(DECLARE_ENV) == "1"):
        return
    _installed = True
    from vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_code2wav import Qwen3TTSCode2Wav

    if os.environ.get(PROBE_ENV):
        _wrap_forward(Qwen3TTSCode2Wav, os.environ[PROBE_ENV])
    if os.environ.get(DECLARE_ENV) == "1":
        _wrap_load_weights(Qwen3TTSCode2Wav)


def read_probes(directory: str | Path) -> list[dict]:
    """The probe files of every stage process that wrote one."""
    return [json.loads(p.read_text()) for p in sorted(Path(directory).glob("tts-probe-*.json"))]
