"""vLLM-Omni 0.30.0's ming-flash-omni talker, built and run on the CPU for the audit.

Why: ming-flash-omni's talker stage (stage 1 of ``deploy/ming_flash_omni.yaml``,
the only stage of ``deploy/ming_flash_omni_tts.yaml``) runs a whole
autoregressive loop inside one ``forward`` call, on a ``transformers``
``StaticCache`` of a hard-coded 2048 positions that vLLM's paged pool never
sees. vLLM-Omni declares it: ``MingAudioGenerator.model_local_kv_specs``
(``ming_flash_omni/talker_module.py``), forwarded by the stage model
``MingFlashOmniTalkerForConditionalGeneration.model_local_kv_specs``
(``ming_flash_omni/ming_flash_omni_talker.py``), as ``talker_llm_static_cache``:
scope invocation, one fixed row, 2048 positions, geometry read from the
talker's ``Qwen2Config`` and dtype from its weights. Whether that declaration
matches what the code holds can only be answered by running vLLM-Omni's own
code, so everything here builds and drives the real objects:

* the stage model ``MingFlashOmniTalkerForConditionalGeneration``, built by
  its own ``__init__`` from a real ``VllmConfig`` (vLLM's ``ModelConfig`` over
  a small ``config.json`` of ``model_type: ming_flash_omni_talker``, which
  vLLM-Omni's ``transformers_utils/configs/ming_flash_omni.py`` registers
  with ``AutoConfig`` when it is imported, so the hf config is vLLM-Omni's
  ``MingFlashOmniTalkerConfig``), under the model dtype as vLLM's loader
  sets it. It builds its ``transformers`` ``Qwen2Model``, its CFM (DiT, with
  ``x_transformers``' rotary embedding), its aggregator and stop head, and
  the ``MingAudioGenerator`` that owns the cache;
* requests go through ``forward`` as the generation runner hands them over
  (``input_ids``, ``positions`` and ``runtime_additional_information``): with
  ``text`` the stage segments it (``text_processing.segment_and_normalize``),
  builds each segment's prompt with its own ``build_tts_input`` and its
  tokenizer, and runs ``MingAudioGenerator.generate_latents`` once per
  segment; without ``text`` it embeds ``input_ids`` and runs it once. Each
  ``generate_latents`` builds its ``StaticCache`` in ``_init_kv_cache`` and
  feeds it to ``Qwen2Model`` step by step (``llm_step``).

What is not vLLM-Omni's here:

* A small model directory in a temporary folder, kept for the life of the
  process: the ``config.json`` (a Qwen2 talker LLM of 2 layers, hidden 64
  over 4 query heads, so head_dim 16, 2 KV heads, bfloat16; a DiT and an
  aggregator of one block each; 2 CFM steps; patch 4, history patch 8,
  latent 8), and ``llm/``, a byte-level tokenizer made with ``tokenizers``
  (the 256 byte symbols plus the chat and audio special tokens
  ``build_tts_input`` encodes), which the stage loads itself
  (``AutoTokenizer.from_pretrained``) from where it looks first. The
  2048-position ``StaticCache`` length is vLLM-Omni's own and is kept.
  No ``vae/`` folder: ``_init_audio_vae`` finds none and builds no
  ``AudioVAE`` (it logs "AudioVAE not found"), so ``forward`` returns the
  latents instead of a waveform. The VAE decodes stateless
  (``use_cache=False``) and holds no attention KV.
* Random weights (seeded), not loaded through ``load_weights``: the weights
  do not change the cache's geometry, and ``load_weights`` only reads
  checkpoint files and voice presets.
* The registration of the stage class with vLLM's ``ModelRegistry``
  (vLLM-Omni does it in ``engine/arg_utils.py``, ``register_omni_models_to_vllm``,
  when its engine arguments are built, which does not happen here), so that
  vLLM's ``ModelConfig`` accepts the architecture.
* Random ``input_ids``, English text, and the sampling knobs a request may
  pass (``max_steps`` small, so a test runs a few decode steps, not 200).
* The observation of the cache. The cache is a local variable of
  ``generate_latents``, gone when ``forward`` returns, so a forward hook on
  the talker's ``Qwen2Model`` (``stage.model``) reads ``past_key_values``
  from each call's keyword arguments (nothing in vLLM-Omni's code is
  changed; :class:`CacheProbe` keeps only weak references unless told to
  keep the last cache), and :func:`talker_after_forward` keeps a reference
  to the cache on the stage as ``kv_budget_static_cache`` so that
  ``kv-budget audit`` sees it as it was when the loop ended. That attribute
  is the one thing on the stage that vLLM-Omni did not make.

The figure at the real checkpoint's geometry (24 layers, 2 KV heads, hidden
896 over 14 heads = head_dim 64, bfloat16) comes from the same stage class
built on the meta device with that LLM config (:func:`real_geometry_declaration`):
vLLM-Omni's declarer computes it, nothing is allocated. It is also measured
(:func:`real_geometry_measured`): the stage built for real with that
attention geometry but the LLM's MLP (8) and vocabulary (320) shrunk, which
the cache does not depend on, and run for one request.

The vLLM set-up around the constructor is :mod:`peers.vllm_omni.vllm_setup`.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import types
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

if "vllm" not in sys.modules:
    # vLLM logs to stdout by default; `kv-budget audit --json` prints its
    # report there. An operator's own setting wins.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

from kv_budget.collect.model import collect_model_local_kv_specs
from kv_budget.sample.caches import cache_breakdown, measure_cache_bytes
from peers.vllm_omni.files import import_omni_module
from peers.vllm_omni.vllm_setup import built_under, finish_loading

__all__ = [
    "MODULE",
    "GENERATOR_MODULE",
    "ARCHITECTURE",
    "DECLARATION",
    "OWNER",
    "DTYPE",
    "LLM_LAYERS",
    "LLM_KV_HEADS",
    "LLM_HEAD_DIM",
    "SMALL_LLM",
    "REAL_LLM",
    "REAL_KV_LLM",
    "NO_TEXT",
    "TWO_SEGMENTS",
    "STATIC_OFF",
    "build_talker",
    "CacheProbe",
    "run_forward",
    "talker_after_forward",
    "talker_after_segments",
    "talker_at_rest",
    "real_geometry_declaration",
    "real_geometry_measured",
    "talker_real_geometry_after_forward",
    "measure",
]

MODULE = "vllm_omni.model_executor.models.ming_flash_omni.ming_flash_omni_talker"
GENERATOR_MODULE = "vllm_omni.model_executor.models.ming_flash_omni.talker_module"
ARCHITECTURE = "MingFlashOmniTalkerForConditionalGeneration"
DECLARATION = "talker_llm_static_cache"

OWNER = ""
"""The declaring owner's path: the stage model is the root of its stage
(``model_arch: MingFlashOmniTalkerForConditionalGeneration`` in
``pipeline.py``) and declares by forwarding to its ``audio_generator``, a
plain object the module walk does not enter."""

DTYPE = torch.bfloat16
"""The talker's dtype: ``build_tts_input`` is called with ``torch.bfloat16``
hard-coded, so the LLM runs in bfloat16."""

LLM_LAYERS = 2
LLM_HEADS = 4
LLM_KV_HEADS = 2
LLM_HIDDEN = 64
LLM_HEAD_DIM = LLM_HIDDEN // LLM_HEADS
"""A small talker LLM: 2 layers, hidden 64 over 4 query heads (head_dim 16),
2 KV heads (grouped-query, so a declaration that used query heads would
show)."""

SPECIAL_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_pad|>",
    "<|vision_end|>",
    "<audio>",
    "<audioPatch>",
)
"""The tokens ``build_tts_input`` encodes and, for a speaker slot or a
reference wav, asserts are single ids."""

VOCAB = 320
"""Byte-level vocabulary (256) plus the special tokens, rounded up."""

SMALL_LLM: dict[str, Any] = {
    "model_type": "qwen2",
    "hidden_size": LLM_HIDDEN,
    "num_attention_heads": LLM_HEADS,
    "num_key_value_heads": LLM_KV_HEADS,
    "num_hidden_layers": LLM_LAYERS,
    "intermediate_size": 64,
    "vocab_size": VOCAB,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
}

REAL_LLM: dict[str, Any] = {
    "model_type": "qwen2",
    "hidden_size": 896,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "num_hidden_layers": 24,
    "intermediate_size": 4864,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "torch_dtype": "bfloat16",
}
"""The talker LLM geometry of the real checkpoint as kv-budget's figures
table has it (24 layers, 2 KV heads, hidden 896 / 14 heads = head_dim 64,
bfloat16; the Qwen2-0.5B shape). Built on the meta device only. The
checkpoint's own ``talker/llm/config.json`` was not read (no network)."""

REAL_KV_LLM: dict[str, Any] = dict(REAL_LLM, intermediate_size=8, vocab_size=VOCAB)
""":data:`REAL_LLM` with the MLP and the vocabulary shrunk (neither touches
the KV geometry): about 45 M parameters, small enough to build and run on
the CPU, so the real-geometry cache is measured as well as declared."""


def _talker_config(llm: dict[str, Any]) -> dict[str, Any]:
    """``config.json`` of the stage: vLLM-Omni's ``MingFlashOmniTalkerConfig``
    fields, the LLM config inline (``_resolve_llm_config`` reads it first)."""
    latent = 8
    return {
        "model_type": "ming_flash_omni_talker",
        "architectures": [ARCHITECTURE],
        "torch_dtype": "bfloat16",
        "llm_config": dict(llm),
        # DiT: its condition embedder takes the LLM hidden state.
        "flowmodel": {
            "in_channels": latent,
            "hidden_size": 32,
            "depth": 1,
            "num_heads": 2,
            "llm_cond_dim": llm["hidden_size"],
        },
        "aggregator": {"hidden_size": 32, "depth": 1, "num_heads": 2},
        "steps": 2,
        "patch_size": 4,
        "history_patch_size": 8,
        "latent_dim": latent,
        "cfg_strength": 2.0,
    }


# --------------------------------------------------------------------------
# Building the real objects

_state: dict[str, Any] = {}


def _modules() -> types.SimpleNamespace:
    """vLLM-Omni's stage file and talker module, imported once, and the stage
    class registered with vLLM's ``ModelRegistry`` (what vLLM-Omni's
    ``register_omni_models_to_vllm`` does). Importing the stage file imports
    ``transformers_utils/configs/ming_flash_omni.py``, which registers
    ``ming_flash_omni_talker`` with ``AutoConfig`` itself."""
    if "modules" in _state:
        return _state["modules"]
    from vllm.model_executor.models import ModelRegistry

    ns = types.SimpleNamespace(stage=import_omni_module(MODULE), talker=import_omni_module(GENERATOR_MODULE))
    ModelRegistry.register_model(ARCHITECTURE, ns.stage.MingFlashOmniTalkerForConditionalGeneration)
    _state["modules"] = ns
    return ns


def _write_tokenizer(directory: Path) -> None:
    """A byte-level BPE tokenizer without merges (every byte one token) plus
    :data:`SPECIAL_TOKENS`, saved as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, additional_special_tokens=list(SPECIAL_TOKENS))
    if len(fast) > VOCAB:
        raise RuntimeError(f"tokenizer has {len(fast)} ids, the LLM vocabulary {VOCAB}")
    fast.save_pretrained(str(directory))


def _model_dir(llm: dict[str, Any]) -> Path:
    """A model directory the stage reads, one per LLM config (vLLM may cache
    a config by path): ``config.json`` (:func:`_talker_config`) and ``llm/``,
    the tokenizer, where the stage looks for it first. Kept for the life of
    the process (the stage resolves its tokenizer lazily, at the first
    request with text)."""
    key = json.dumps(llm, sort_keys=True)
    dirs = _state.setdefault("dirs", {})
    if key not in dirs:
        holder = tempfile.TemporaryDirectory(prefix="kv-budget-ming-talker-")
        root = Path(holder.name)
        (root / "config.json").write_text(json.dumps(_talker_config(llm)))
        _write_tokenizer(root / "llm")
        dirs[key] = (holder, root)
    return dirs[key][1]


def _vllm_config(root: Path) -> Any:
    """A real ``VllmConfig`` over ``root``: the ``ModelConfig`` reads its
    ``config.json`` (no tokenizer init, eager: ``enforce_eager: true`` is
    what both ming deploy files give the talker stage)."""
    from vllm.config import ModelConfig, VllmConfig

    model = ModelConfig(
        model=str(root),
        dtype=str(DTYPE).removeprefix("torch."),
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=256,
    )
    return VllmConfig(model_config=model)


def build_talker(llm: dict[str, Any] | None = None, *, meta: bool = False) -> torch.nn.Module:
    """vLLM-Omni's ``MingFlashOmniTalkerForConditionalGeneration`` built by
    its own ``__init__`` under a real ``VllmConfig`` whose model directory is
    :func:`_model_dir` (random weights, seeded). ``llm`` is the talker LLM's
    config (default :data:`SMALL_LLM`). With ``meta`` the stage is built on
    the meta device: nothing is allocated and it cannot run, but it
    declares."""
    ns = _modules()
    vllm_config = _vllm_config(_model_dir(llm or SMALL_LLM))
    with built_under(vllm_config):
        torch.manual_seed(0)
        if meta:
            with torch.device("meta"):
                return ns.stage.MingFlashOmniTalkerForConditionalGeneration(vllm_config=vllm_config, prefix="")
        stage = ns.stage.MingFlashOmniTalkerForConditionalGeneration(vllm_config=vllm_config, prefix="")
    return finish_loading(stage, vllm_config)


# --------------------------------------------------------------------------
# Watching the cache


@dataclass
class CacheSeen:
    """One cache object the talker's LLM was called with, as it was after
    the first call that wrote into it (a ``StaticLayer`` allocates on its
    first write)."""

    cache_class: str
    calls: int = 0
    bytes_after_first_call: int = 0
    bytes_after_last_call: int = 0
    positions_per_layer: list[int] = field(default_factory=list)
    rows_per_layer: list[int] = field(default_factory=list)
    layers: int = 0
    seen_tokens_after_last_call: int = 0
    earlier_caches_alive_at_first_call: int = 0
    """How many caches seen before this one were still alive (weak
    references not dead) after this one's first write: more than 0 means two
    caches existed at once."""


class CacheProbe:
    """A forward hook on the talker's ``Qwen2Model`` that records every
    ``past_key_values`` it is called with, and, when the stage passes none
    (``use_static_cache`` off), the cache the model made and returned.

    Holds weak references only, so it cannot keep a finished segment's cache
    alive; with ``keep_last`` it also keeps the last cache (for the audit
    target that keeps it on the stage)."""

    def __init__(self, stage: torch.nn.Module, *, keep_last: bool = False) -> None:
        self.keep_last = keep_last
        self.last: Any = None
        self.seen: list[CacheSeen] = []
        self.caches_passed_in = 0
        self.calls_without_cache = 0
        self._refs: list[weakref.ref] = []
        self._handle = stage.model.register_forward_hook(self._after, with_kwargs=True)

    def _index(self, cache: Any) -> int | None:
        for i, ref in enumerate(self._refs):
            if ref() is cache:
                return i
        return None

    def _after(self, _module: Any, _args: Any, kwargs: dict[str, Any], output: Any) -> None:
        passed = kwargs.get("past_key_values")
        if passed is None:
            self.calls_without_cache += 1
            cache = getattr(output, "past_key_values", None)
        else:
            self.caches_passed_in += 1
            cache = passed
        if cache is None:
            return
        index = self._index(cache)
        bytes_now = measure_cache_bytes(cache)
        if index is None:
            alive = sum(ref() is not None for ref in self._refs)
            layers = cache_breakdown(cache)
            self._refs.append(weakref.ref(cache))
            self.seen.append(
                CacheSeen(
                    cache_class=type(cache).__name__,
                    bytes_after_first_call=bytes_now,
                    positions_per_layer=sorted({layer.positions for layer in layers}),
                    rows_per_layer=sorted({layer.batch for layer in layers if layer.batch is not None}),
                    layers=len(layers),
                    earlier_caches_alive_at_first_call=alive,
                )
            )
            index = len(self.seen) - 1
        entry = self.seen[index]
        entry.calls += 1
        entry.bytes_after_last_call = bytes_now
        entry.seen_tokens_after_last_call = int(cache.get_seq_length())
        if self.keep_last:
            self.last = cache

    def remove(self) -> None:
        self._handle.remove()

    def alive(self) -> int:
        """Caches seen so far that still exist now."""
        return sum(ref() is not None for ref in self._refs)


def _input_ids(count: int, seed: int = 0) -> torch.Tensor:
    """Random token ids, 1-D as vLLM passes them (weights are random too)."""
    return torch.randint(0, VOCAB, (count,), generator=torch.Generator().manual_seed(seed))


def run_forward(
    stage: torch.nn.Module,
    infos: list[dict[str, Any]],
    *,
    prompt_tokens: int = 6,
    keep_last: bool = False,
) -> tuple[Any, CacheProbe]:
    """One ``forward`` call of the stage as the generation runner makes it:
    ``prompt_tokens`` ids (1-D, with their positions) and one
    ``runtime_additional_information`` entry per scheduled request. Returns
    the stage's ``OmniOutput`` and what the probe saw (its ``alive()`` read
    right after is what outlived the call)."""
    ids = _input_ids(prompt_tokens)
    probe = CacheProbe(stage, keep_last=keep_last)
    # The cyclic collector stays off during the call, so a cache the probe
    # reports freed was freed by its last reference going away, not by a
    # collection that happened to run in between.
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.no_grad():
            output = stage.forward(
                input_ids=ids, positions=torch.arange(prompt_tokens), runtime_additional_information=infos
            )
    finally:
        probe.remove()
        if collecting:
            gc.enable()
    return output, probe


NO_TEXT = {"max_steps": 3}
"""A request without text: the stage embeds ``input_ids`` and runs one
``generate_latents`` of 3 decode steps."""

TWO_SEGMENTS = {
    "text": "The quick brown fox jumps over the lazy dog today. It runs far away across the green field now.",
    "max_text_length": 12,
    "max_steps": 2,
}
"""A request with text that ``segment_and_normalize`` cuts into two segments
(max semantic length 12 words): two ``generate_latents`` calls, one cache
each, one after the other."""

STATIC_OFF = {"max_steps": 3, "use_static_cache": False}
"""A request that turns the static cache off (``use_static_cache`` is read
from the request's additional information)."""


# --------------------------------------------------------------------------
# Audit targets (``kv-budget audit peers.vllm_omni.ming_flash_omni:NAME``)


def talker_after_forward() -> torch.nn.Module:
    """The stage after one request (no text, 3 decode steps), holding the
    ``StaticCache`` that request's ``generate_latents`` built as
    ``kv_budget_static_cache``. Why: the cache lives only inside the call;
    kept, the audit sees it as it was when the loop ended, which for a
    static cache is its whole life (allocated in full on the first write)."""
    stage = build_talker()
    _, probe = run_forward(stage, [dict(NO_TEXT)], keep_last=True)
    stage.kv_budget_static_cache = probe.last
    return stage


def talker_after_segments() -> torch.nn.Module:
    """The stage after one request with text of two segments, keeping the
    last segment's cache (the first one is gone by then)."""
    stage = build_talker()
    _, probe = run_forward(stage, [dict(TWO_SEGMENTS)], keep_last=True)
    stage.kv_budget_static_cache = probe.last
    return stage


def talker_real_geometry_after_forward() -> torch.nn.Module:
    """:func:`talker_after_forward` at the real KV geometry
    (:data:`REAL_KV_LLM`): the 24 MiB cache the figures table quotes."""
    stage = build_talker(REAL_KV_LLM)
    _, probe = run_forward(stage, [dict(NO_TEXT)], keep_last=True)
    stage.kv_budget_static_cache = probe.last
    return stage


def talker_at_rest() -> torch.nn.Module:
    """The stage after the same request as :func:`talker_after_forward`, with
    nothing kept: what an audit of a served model between calls sees."""
    stage = build_talker()
    run_forward(stage, [dict(NO_TEXT)])
    return stage


# --------------------------------------------------------------------------
# Figures for the docs and tests


def _declared(stage: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """What kv-budget's collector reads from the stage, keyed OWNER/NAME."""
    return {
        f"{owned.owner}/{owned.spec.name}": {
            "scope": owned.spec.scope.value,
            "rows": owned.spec.rows.value,
            "rows_fixed": owned.spec.rows_fixed,
            "layers": owned.spec.layers,
            "kv_heads": owned.spec.kv_heads,
            "head_dim": owned.spec.head_dim,
            "dtype": str(owned.spec.dtype),
            "positions": owned.spec.physical_capacity_positions,
            "bytes_per_row": owned.spec.bytes_per_row,
            "capacity_source": owned.spec.capacity_source,
        }
        for owned in collect_model_local_kv_specs(stage).specs
    }


def _own_declaration(stage: torch.nn.Module) -> dict[str, Any]:
    """vLLM-Omni's own spec object, straight from the stage's declarer (no
    kv-budget conversion), as plain values."""
    (spec,) = stage.model_local_kv_specs()
    return {
        "class": f"{type(spec).__module__}.{type(spec).__qualname__}",
        "name": spec.name,
        "layers": spec.layers,
        "kv_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "dtype": str(spec.dtype),
        "positions": spec.physical_capacity_positions,
        "scope": spec.scope.value,
        "rows": spec.rows.value,
        "rows_fixed": spec.rows_fixed,
        "generator_static_cache_len": type(stage.audio_generator)._STATIC_CACHE_LEN,
    }


def real_geometry_declaration() -> dict[str, Any]:
    """vLLM-Omni's declarer on the stage built on the meta device with the
    real talker LLM geometry (:data:`REAL_LLM`): per row, the figure a
    deployment declares, without allocating it."""
    stage = build_talker(REAL_LLM, meta=True)
    declared = _declared(stage)
    own = _own_declaration(stage)
    return {
        "parameters_on": str(next(stage.model.parameters()).device),
        "declared": declared,
        "vllm_omni_spec": own,
        "bytes_per_row": declared[f"{OWNER}/{DECLARATION}"]["bytes_per_row"],
    }


def real_geometry_measured() -> dict[str, Any]:
    """The stage built for real with :data:`REAL_KV_LLM` (24 layers, 2 KV
    heads, head_dim 64, bfloat16) and run for one request without text
    (:data:`NO_TEXT`): the declaration and the cache its forward allocates,
    both per row, measured."""
    stage = build_talker(REAL_KV_LLM)
    declared = _declared(stage)[f"{OWNER}/{DECLARATION}"]
    _, probe = run_forward(stage, [dict(NO_TEXT)])
    return {"declared": declared, "caches": _cache_figures(probe), "alive_after_forward": probe.alive()}


def _cache_figures(probe: CacheProbe) -> list[dict[str, Any]]:
    return [asdict(entry) for entry in probe.seen]


def measure() -> dict[str, Any]:
    """The figures ``docs/vllm-omni-ming-flash-omni.md`` quotes, every one
    from vLLM-Omni's own code: the declaration (as vLLM-Omni makes it and as
    kv-budget reads it), the cache one request builds (bytes, positions,
    rows, after every decode step), two text segments, a call carrying two
    requests, the static cache turned off, what is held after the call, and
    the declaration at the real geometry."""
    stage = build_talker()
    declared = _declared(stage)

    output, probe = run_forward(stage, [dict(NO_TEXT)])
    one = _cache_figures(probe)
    no_text = {
        "caches": one,
        "llm_calls": probe.caches_passed_in + probe.calls_without_cache,
        "alive_after_forward": probe.alive(),
        "latent_frames": int(output.multimodal_outputs["audio_latents"].shape[1]),
        "declared_bytes_at_one_row": declared[f"{OWNER}/{DECLARATION}"]["bytes_per_row"],
    }

    _, probe = run_forward(stage, [dict(TWO_SEGMENTS)])
    segments = {
        "caches": _cache_figures(probe),
        "llm_calls": probe.caches_passed_in,
        "alive_after_forward": probe.alive(),
    }

    _, probe = run_forward(stage, [dict(NO_TEXT), dict(NO_TEXT)], prompt_tokens=12)
    two_requests = {"caches": _cache_figures(probe), "llm_calls": probe.caches_passed_in}

    _, probe = run_forward(stage, [dict(STATIC_OFF)])
    static_off = {
        "caches": _cache_figures(probe),
        "calls_with_cache_passed_in": probe.caches_passed_in,
        "calls_without_cache": probe.calls_without_cache,
    }

    # A prompt as long as the cache (vLLM-Omni's own length): generate_latents
    # bounds its loop by max_cache_len - prefill_len, so no step runs.
    cache_len = type(stage.audio_generator)._STATIC_CACHE_LEN
    output, probe = run_forward(stage, [dict(NO_TEXT)], prompt_tokens=cache_len)
    prompt_fills_cache = {
        "prompt_tokens": cache_len,
        "llm_calls": probe.caches_passed_in + probe.calls_without_cache,
        "caches": _cache_figures(probe),
        "outputs": sorted(output.multimodal_outputs),
    }

    return {
        "geometry": {
            "layers": LLM_LAYERS,
            "kv_heads": LLM_KV_HEADS,
            "head_dim": LLM_HEAD_DIM,
            "dtype": str(DTYPE),
            "parameter_dtype": str(next(stage.model.parameters()).dtype),
            "audio_vae": stage.audio_vae is not None,
            "use_cuda_graphs": stage.audio_generator._use_cuda_graphs,
            "sampler_pool": stage.audio_generator._sampler_pool is not None,
        },
        "declared": declared,
        "vllm_omni_spec": _own_declaration(stage),
        "no_text": no_text,
        "two_segments": segments,
        "two_requests_in_one_call": two_requests,
        "static_cache_off": static_off,
        "prompt_fills_cache": prompt_fills_cache,
        "real_geometry": real_geometry_declaration(),
        "real_geometry_run": real_geometry_measured(),
    }


def _main() -> int:
    """``python -m peers.vllm_omni.ming_flash_omni``: print :func:`measure`
    as JSON, the source of every figure in ``docs/vllm-omni-ming-flash-omni.md``."""
    print(json.dumps(measure(), indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
