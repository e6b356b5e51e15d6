"""Tiny real models for the audit tests, built offline from configs with
random weights, and owner modules that keep caches the way served models do.

Each owner declares with :func:`spec_from_hf_config` from the same config its
cache is built from, like a real declarer would. Geometry is small so the
whole test file runs in seconds on a CPU; the one exception is the ming talker
geometry (24 layers, hidden 896), whose 24 MiB static cache is the figure the
design document quotes.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import (
    DynamicCache,
    Qwen2Config,
    Qwen2ForCausalLM,
    StaticCache,
    WhisperConfig,
    WhisperForConditionalGeneration,
)

from kv_budget.declare.hf_config import spec_from_hf_config
from kv_budget.declare.spec import ModelLocalKVSpec, RowDriver, Scope

VOCAB = 128
MING_STATIC_POSITIONS = 2048


def small_qwen2_config(*, sliding_window: int | None = None, layers: int = 2) -> Qwen2Config:
    """hidden 64, 4 heads, 2 kv heads (head_dim 16). With a window, every
    layer is "sliding_attention": Qwen2 otherwise marks only layers at or
    above ``max_window_layers`` (default 28) as sliding, and a DynamicCache
    built from the config would get full layers."""
    kwargs: dict[str, Any] = {}
    if sliding_window is not None:
        kwargs = {
            "sliding_window": sliding_window,
            "use_sliding_window": True,
            "layer_types": ["sliding_attention"] * layers,
        }
    return Qwen2Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=layers,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        **kwargs,
    )


def ming_talker_config() -> Qwen2Config:
    """The ming-flash-omni talker geometry: 24 layers, 2 kv heads,
    hidden 896 / 14 heads = head_dim 64. Vocab and MLP are shrunk: they do not
    touch the KV geometry and keep the random model small."""
    return Qwen2Config(
        hidden_size=896,
        num_attention_heads=14,
        num_key_value_heads=2,
        num_hidden_layers=24,
        intermediate_size=8,
        vocab_size=VOCAB,
        max_position_embeddings=MING_STATIC_POSITIONS,
    )


def whisper_config(
    *,
    encoder_layers: int = 2,
    decoder_layers: int = 2,
    encoder_heads: int = 4,
    decoder_heads: int = 4,
    max_source_positions: int = 16,
) -> WhisperConfig:
    """A tiny Whisper: d_model 64, 8 mel bins, ``max_source_positions``
    encoder frames (the input has twice as many: the conv stem strides 2)."""
    return WhisperConfig(
        d_model=64,
        encoder_layers=encoder_layers,
        decoder_layers=decoder_layers,
        encoder_attention_heads=encoder_heads,
        decoder_attention_heads=decoder_heads,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        vocab_size=64,
        num_mel_bins=8,
        max_source_positions=max_source_positions,
        max_target_positions=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )


def tiny_lm(config: Qwen2Config, dtype: torch.dtype = torch.float32, seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).to(dtype).eval()


def generate_into(lm: Qwen2ForCausalLM, cache: Any, *, batch: int, prompt: int, new_tokens: int) -> Any:
    """Greedy generation of exactly ``new_tokens`` into ``cache``; the cache
    then has seen ``prompt + new_tokens - 1`` tokens (the last one is never
    fed back)."""
    generator = torch.Generator().manual_seed(batch * 1000 + prompt)
    ids = torch.randint(3, VOCAB, (batch, prompt), generator=generator)
    with torch.no_grad():
        lm.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=cache,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return cache


class Declarer(torch.nn.Module):
    """An owner that keeps whatever the test sets as attributes and declares
    the given specs: the shape of most hand-written declarers."""

    def __init__(self, specs: list[Any] | None = None) -> None:
        super().__init__()
        self.declared = list(specs or [])

    def model_local_kv_specs(self) -> list[Any]:
        return list(self.declared)


REQUEST_ROW_BYTES = 2 * 64 * 4 * 100
"""One row of :class:`RequestDeclaringModel`'s declaration: K and V, head_dim 64, fp32, 100 positions."""


class RequestDeclaringModel(torch.nn.Module):
    """A model whose child ``talker`` declares one per-request cache of
    :data:`REQUEST_ROW_BYTES` per row and holds nothing: what the startup
    path plans from, without a cache to build."""

    def __init__(self) -> None:
        super().__init__()
        from kv_budget.declare.spec import ModelLocalKVSpec

        self.talker = Declarer([ModelLocalKVSpec(
            name="kv", layers=1, kv_heads=1, head_dim=64, dtype=torch.float32, physical_capacity_positions=100,
            capacity_source="test", scope="request", rows="max_num_seqs")])


class BrokenDeclarer(torch.nn.Module):
    """A declarer with a bug: the audit must record it, not crash."""

    def __init__(self) -> None:
        super().__init__()
        self.cache: Any = None

    def model_local_kv_specs(self) -> list[Any]:
        raise RuntimeError("config attribute missing")


class SlidingCodecDecoder(torch.nn.Module):
    """Like the Qwen3-TTS codec decoder: one sliding-window DynamicCache per
    running request (batch k = k sequences), and optionally a per-call
    working copy (``copy.deepcopy``) kept in its own attribute.

    ``declared_positions`` is what the declarer claims one row holds;
    ``declare_working_copy`` adds the second declaration.
    """

    def __init__(
        self,
        *,
        window: int,
        declared_positions: int,
        capacity_source: str,
        keep_working_copy: bool = False,
        declare_working_copy: bool = False,
    ) -> None:
        super().__init__()
        self.config = small_qwen2_config(sliding_window=window)
        self.lm = tiny_lm(self.config)
        self.declared_positions = declared_positions
        self.capacity_source = capacity_source
        self.keep_working_copy = keep_working_copy
        self.declare_working_copy = declare_working_copy
        self.cache: DynamicCache | None = None
        self.working: DynamicCache | None = None

    def run(self, *, batch: int, prompt: int, new_tokens: int) -> None:
        self.cache = generate_into(
            self.lm, DynamicCache(config=self.config), batch=batch, prompt=prompt, new_tokens=new_tokens
        )
        if self.keep_working_copy:
            self.working = copy.deepcopy(self.cache)

    def _spec(self, name: str, scope: Scope) -> ModelLocalKVSpec:
        return spec_from_hf_config(
            self.config,
            name=name,
            dtype=torch.float32,
            physical_capacity_positions=self.declared_positions,
            capacity_source=self.capacity_source,
            scope=scope,
            rows=RowDriver.MAX_NUM_SEQS,
        )

    def model_local_kv_specs(self) -> list[ModelLocalKVSpec]:
        specs = [self._spec("codec_cache", Scope.REQUEST)]
        if self.declare_working_copy:
            specs.append(self._spec("codec_cache_working_copy", Scope.INVOCATION))
        return specs


class MingTalker(torch.nn.Module):
    """The ming-flash-omni talker: a StaticCache of a hard-coded 2048
    positions, batch 1, bf16; calls are serialized, so one row."""

    def __init__(self, lm: Qwen2ForCausalLM | None = None) -> None:
        super().__init__()
        self.config = ming_talker_config()
        self.lm = lm if lm is not None else tiny_lm(self.config, torch.bfloat16)
        self.static_cache: StaticCache | None = None

    def run(self, tokens: int = 4) -> None:
        self.static_cache = StaticCache(config=self.config, max_cache_len=MING_STATIC_POSITIONS)
        ids = torch.randint(3, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            self.lm(ids, past_key_values=self.static_cache, use_cache=True)

    def model_local_kv_specs(self) -> list[ModelLocalKVSpec]:
        return [
            spec_from_hf_config(
                self.config,
                name="talker_static_cache",
                dtype=torch.bfloat16,
                physical_capacity_positions=MING_STATIC_POSITIONS,
                capacity_source="hard-coded StaticCache max_cache_len",
                scope=Scope.SESSION,
                rows=RowDriver.FIXED,
                rows_fixed=1,
                rows_reason="talker calls are serialized",
            )
        ]


class MingOmni(torch.nn.Module):
    """A root whose talker sits one level down, as in the served model."""

    def __init__(self, lm: Qwen2ForCausalLM | None = None) -> None:
        super().__init__()
        self.talker = MingTalker(lm)


def build_ming_omni() -> MingOmni:
    """Factory for ``load_factory``: the model after one talker call."""
    model = MingOmni()
    model.talker.run()
    return model


class WhisperDecoderOwner(torch.nn.Module):
    """Keeps the EncoderDecoderCache of a Whisper decoding loop. Declares the
    two halves separately: the decoder self-attention grows with decoder
    tokens (bounded by ``max_decoder_tokens``), the cross-attention holds the
    encoder output, ``max_source_positions`` frames, in the *decoder* layers
    with the *decoder* heads."""

    def __init__(self, config: WhisperConfig, *, max_decoder_tokens: int) -> None:
        super().__init__()
        self.config = config
        torch.manual_seed(0)
        self.model = WhisperForConditionalGeneration(config).eval()
        self.max_decoder_tokens = max_decoder_tokens
        self.past: Any = None

    def run(self, *, batch: int) -> None:
        """Encode once, then decode ``max_decoder_tokens`` tokens: a prompt of
        2 and single-token steps after it, each reusing the cache."""
        generator = torch.Generator().manual_seed(3)
        features = torch.randn(
            batch, self.config.num_mel_bins, 2 * self.config.max_source_positions, generator=generator
        )
        prompt = torch.tensor([[1, 5]] * batch)
        with torch.no_grad():
            out = self.model(input_features=features, decoder_input_ids=prompt, use_cache=True)
            encoder_outputs = (out.encoder_last_hidden_state,)
            past = out.past_key_values
            for step in range(self.max_decoder_tokens - prompt.shape[1]):
                nxt = torch.full((batch, 1), 6 + step)
                out = self.model(
                    encoder_outputs=encoder_outputs,
                    decoder_input_ids=nxt,
                    past_key_values=past,
                    use_cache=True,
                )
                past = out.past_key_values
        self.past = past

    def self_attention_spec(self) -> ModelLocalKVSpec:
        return spec_from_hf_config(
            self.config,
            name="whisper_decoder_self_attention",
            dtype=torch.float32,
            physical_capacity_positions=self.max_decoder_tokens,
            capacity_source="decode loop trip count",
            scope=Scope.REQUEST,
            rows=RowDriver.MAX_NUM_SEQS,
            stack="decoder",
        )

    def cross_attention_spec(self) -> ModelLocalKVSpec:
        return spec_from_hf_config(
            self.config,
            name="whisper_cross_attention",
            dtype=torch.float32,
            physical_capacity_positions=self.config.max_source_positions,
            capacity_source="encoder output length = max_source_positions",
            scope=Scope.REQUEST,
            rows=RowDriver.MAX_NUM_SEQS,
            stack="decoder",
        )

    def model_local_kv_specs(self) -> list[ModelLocalKVSpec]:
        return [self.self_attention_spec(), self.cross_attention_spec()]


NOT_CALLABLE = 42
"""For the load_factory test: an attribute that is not a factory."""


def returns_none() -> None:
    """For the load_factory test: a factory that builds nothing."""
    return None


def build_sliding_declared_window_minus_one() -> SlidingCodecDecoder:
    """Factory for the CLI test: a sliding-window codec cache declared with
    the usual ``sliding_window - 1`` after decoding past its window. The
    storage really holds W positions, so the audit must say under-declared."""
    window = 8
    decoder = SlidingCodecDecoder(
        window=window, declared_positions=window - 1, capacity_source="sliding_window - 1"
    )
    decoder.run(batch=2, prompt=4, new_tokens=12)
    return decoder
