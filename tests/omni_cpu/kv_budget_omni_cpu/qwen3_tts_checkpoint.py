"""Test support: a small Qwen3-TTS checkpoint for vLLM-Omni 0.30.0's own Qwen3-TTS pipeline.

Test support, not vLLM-Omni code and not part of kv-budget. What it
replaces: a real Qwen3-TTS checkpoint (``Qwen3-TTS-12Hz-*-CustomVoice`` or
``-Base``, gigabytes, not on this machine). Why it is shaped like this: the
pipeline that serves it (talker stage 0, code2wav stage 1) is vLLM-Omni's
own, so everything it reads is laid out as the real checkpoint lays it out,
only narrower:

* ``config.json``: ``model_type: qwen3_tts`` (so vLLM-Omni picks its own
  ``qwen3_tts`` pipeline and deploy), the real architecture name, a
  ``talker_config`` with the real codec vocabulary (3072 ids, end of speech
  2150, the real think/pad/bos ids, language and speaker tables), M-RoPE
  with an interleaved section as the real talker has, and a code predictor;
  a ``speaker_encoder_config``.
* which tasks it serves (``tts_model_type``, see
  :func:`write_qwen3_tts_checkpoint`): by default **both** preset voices
  (CustomVoice: the ``spk_id`` table) and voice clones (Base: a reference
  audio and its text, the talker encoding the audio into reference codes
  and a speaker embedding). A real checkpoint is one or the other and says
  so in ``tts_model_type``, which vLLM-Omni's speech endpoint reads as the
  only task it accepts (``tts_adapters/qwen3_tts.py``, ``_get_model_variant``:
  any other ``task_type`` is refused); without the field (a metadata-less
  re-export, which that function handles by the checkpoint's path, and none
  of whose components may then end in ``base``, ``customvoice`` or
  ``voicedesign``) it accepts every task, and the model code reads the field
  nowhere else. ``"custom_voice"`` and ``"base"`` write the real field and
  lay the checkpoint out as that variant ships.
* a byte-level text tokenizer built with ``tokenizers`` (``tokenizer.json``)
  whose chat-template pieces ``<|im_start|>``, ``assistant``, ``\\n`` and the
  TTS special tokens are one token each, as the talker's prompt builder
  slices them (role ``[:3]``, text ``[3:-5]``).
* ``model.safetensors``: random talker weights under the real checkpoint's
  names (``talker.model.*``, ``talker.codec_head``, ``talker.text_projection``,
  ``talker.code_predictor.*``), loaded by the talker's own ``load_weights``
  (q/k/v and gate/up as separate shards, as HF ships them); and, where
  voice clones are served (as a Base checkpoint ships them), the ECAPA-TDNN
  speaker encoder's (``speaker_encoder.*``), saved from vLLM-Omni's own
  ``Qwen3TTSSpeakerEncoder`` built small and seeded (a CustomVoice checkpoint
  has none; the talker then keeps its own unseeded initialisation). The
  code2wav stage's loader also opens the root weights (it drains them and
  reads ``speech_tokenizer/``): this file is what it finds.
* **the talker ends speech as soon as it may** (:data:`EOS_CHANNEL`): every
  codec embedding carries +1 on hidden channel 0 (a constant channel, as
  trained transformers grow), so the talker's last hidden state points
  along it at every step, and ``talker.codec_head``'s end-of-speech row
  reads it with weight :data:`EOS_WEIGHT`: end of speech wins sampling
  (p > 0.99999 at the deploy's temperature 0.9) wherever the sampler allows
  it, i.e. once ``min_tokens`` codec frames exist. Why: vLLM-Omni's endpoint
  refuses a voice clone whose talker stopped on its token budget
  (``Qwen3TTSAdapter.validate_generation``: ``finish_reason`` ``length`` is
  "incomplete", HTTP 500 after one retry), and random weights stop at a
  random frame; so a clone asks ``max_new_tokens`` = the deploy's fixed
  frames + 1 and ends, with ``finish_reason`` ``stop``, after exactly those
  frames (the end-of-speech step carries no codec frame). Preset voices,
  whose budget equals ``min_tokens`` in the deploy, never reach the token.
* ``speech_tokenizer/``: vLLM-Omni's own ``Qwen3TTSTokenizerV2Config``
  (a small Mimi encoder, the code2wav decoder with the real
  ``sliding_window`` 72), a feature-extractor config as Mimi's, and weights
  saved from vLLM-Omni's own freshly built ``Qwen3TTSTokenizerV2Encoder`` and
  ``Qwen3TTSTokenizerV2Decoder`` (``encoder.*``, ``decoder.*``), the
  encoder's vector-quantiser codebooks seeded random (Mimi initialises them
  to zeros, which would encode every reference into code 0).

Widths (each one the smallest that keeps the real structure):

* talker: 2 layers, hidden 64, 2 query heads and 1 KV head of
  :data:`TALKER_HEAD_DIM` 32. Why 32 and not 16: vLLM's CPU attention
  refuses head_dim 16 (``_custom_ops.py``), and the talker runs on vLLM's
  paged attention.
* :data:`NUM_CODE_GROUPS` 4 code groups (real: 16) over a codebook of
  :data:`CODEBOOK_SIZE` 64; the decoder has as many quantizers.
* decoder (code2wav's model-local KV, never vLLM's pool): the geometry
  constants below, which are those of ``peers/vllm_omni/qwen3_tts.py`` (the
  single-stage audit of the same decoder) so figures compare.
* encoder (reference audio to codes, voice clones only): Mimi's structure
  with strides 8, 5, 4 and its own downsampling by 2, i.e. one frame per
  :data:`ENCODE_DOWNSAMPLE` (320) samples, :data:`ENCODER_FRAME_RATE` 75 Hz
  at 24 kHz (real: 12.5 Hz, strides 8, 6, 5, 4). Why: the speech endpoint
  refuses references shorter than 1 s, and the decoder keeps at most the
  last ``codec_left_context_frames`` (72) reference frames; at 75 Hz the
  shortest reference (1 s, :data:`REFERENCE_FRAMES_PER_SECOND`) gives 75
  frames, past that bound as a real 6 s reference is, while the talker's
  prompt stays short (about 90 positions) and a request body small. A
  reference must be at 24 kHz: resampling needs torchaudio.
* speaker encoder (voice clones only): ECAPA-TDNN channels 32 (real: 512,
  1536 for the aggregation), the real kernel sizes and dilations, embedding
  width the talker's hidden 64 (the prompt builder requires it).

Deterministic: every tensor comes from a seeded generator, so two calls
write byte-identical weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = [
    "DECODER_LAYERS", "DECODER_KV_HEADS", "DECODER_HEAD_DIM", "DECODER_WINDOW", "DECODER_DTYPE",
    "NUM_CODE_GROUPS", "CODEBOOK_SIZE", "CODEC_EOS", "SPEAKERS", "DEFAULT_SPEAKER", "SAMPLES_PER_FRAME",
    "OUTPUT_SAMPLE_RATE", "SEED", "TALKER_HEAD_DIM", "ENCODE_DOWNSAMPLE", "ENCODER_FRAME_RATE",
    "REFERENCE_FRAMES_PER_SECOND", "EOS_CHANNEL", "EOS_WEIGHT", "TTS_MODEL_TYPES",
    "write_qwen3_tts_checkpoint", "decoder_bytes_per_position_row", "reference_frames",
]

SEED = 0

# ---- code2wav decoder (speech_tokenizer/ decoder_config): model-local KV ----
DECODER_LAYERS = 2
DECODER_KV_HEADS = 2
DECODER_HEAD_DIM = 16
"""hidden 64 over 4 query heads; 2 KV heads (grouped-query)."""
DECODER_WINDOW = 72
"""``sliding_window`` of the real checkpoint, kept: the connector's
``codec_left_context_frames`` (72) is set to match it."""
DECODER_DTYPE = torch.bfloat16
"""Stage 1's ``dtype`` in vLLM-Omni's ``deploy/qwen3_tts.yaml`` (kept)."""

NUM_CODE_GROUPS = 4
CODEBOOK_SIZE = 64
CODEC_EOS = 2150
"""``codec_eos_token_id``: the pipeline's stop token (``stop_token_ids: [2150]``
in vLLM-Omni's ``qwen3_tts`` pipeline)."""
OUTPUT_SAMPLE_RATE = 24000
_UPSAMPLE_RATES = (2, 2)
_UPSAMPLING_RATIOS = (2, 2)
SAMPLES_PER_FRAME = 16
"""Waveform samples the decoder makes per codec frame (2*2*2*2)."""

_DECODER_CONFIG = dict(
    num_hidden_layers=DECODER_LAYERS,
    hidden_size=DECODER_HEAD_DIM * 4,
    num_attention_heads=4,
    num_key_value_heads=DECODER_KV_HEADS,
    sliding_window=DECODER_WINDOW,
    latent_dim=32,
    codebook_size=CODEBOOK_SIZE,
    codebook_dim=32,
    num_quantizers=NUM_CODE_GROUPS,
    upsample_rates=list(_UPSAMPLE_RATES),
    upsampling_ratios=list(_UPSAMPLING_RATIOS),
    decoder_dim=32,
    intermediate_size=64,
)

# Mimi encoder: strides 8*5*4 then Mimi's own downsample by 2
# (frame_rate = 24000 / 160 / 2 = 75 Hz): one frame per 320 samples.
ENCODE_DOWNSAMPLE = 320
ENCODER_FRAME_RATE = OUTPUT_SAMPLE_RATE / ENCODE_DOWNSAMPLE
REFERENCE_FRAMES_PER_SECOND = int(ENCODER_FRAME_RATE)
"""Reference codes per second of 24 kHz reference audio (75)."""
_ENCODER_CONFIG = dict(
    sampling_rate=OUTPUT_SAMPLE_RATE,
    hidden_size=32,
    num_filters=8,
    upsampling_ratios=[8, 5, 4],
    codebook_size=CODEBOOK_SIZE,
    codebook_dim=16,
    vector_quantization_hidden_dimension=16,
    num_quantizers=NUM_CODE_GROUPS,
    num_semantic_quantizers=1,
    upsample_groups=32,
    num_hidden_layers=1,
    intermediate_size=64,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=250,
    frame_rate=ENCODER_FRAME_RATE,
)

# ---- talker (stage 0, vLLM's paged KV) ----
TALKER_LAYERS = 2
TALKER_HIDDEN = 64
TALKER_HEADS = 2
TALKER_KV_HEADS = 1
TALKER_HEAD_DIM = 32
TALKER_INTERMEDIATE = 128
TALKER_VOCAB = 3072
CODE_PREDICTOR_LAYERS = 1
EOS_CHANNEL = 0
"""The talker's hidden channel every codec embedding sets to +1."""
EOS_WEIGHT = 2.0
"""``talker.codec_head``'s end-of-speech row on :data:`EOS_CHANNEL` (its other
rows and channels: N(0, 0.02)). The final RMSNorm makes that channel about
sqrt(64) = 8, so end of speech scores about 16 against about 0.2 for any code."""

TTS_MODEL_TYPES = (None, "custom_voice", "base")
"""``tts_model_type`` values :func:`write_qwen3_tts_checkpoint` writes (None: the field is left out)."""

_SPEAKER_ENCODER_CONFIG = {
    "mel_dim": 128,
    "enc_dim": TALKER_HIDDEN,
    "enc_channels": [32, 32, 32, 32, 96],
    "enc_kernel_sizes": [5, 3, 3, 3, 1],
    "enc_dilations": [1, 2, 3, 4, 1],
    "enc_attention_channels": 16,
    "enc_res2net_scale": 4,
    "enc_se_channels": 16,
    "sample_rate": OUTPUT_SAMPLE_RATE,
}

# ---- text tokenizer: 256 byte tokens, then the special and template tokens ----
_SPECIAL = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|tts_pad|>", "<|tts_text_bos|>", "<|tts_text_eod|>",
    "<|tts_text_bos_single|>", "<|audio_start|>", "<|audio_end|>",
]
_TEMPLATE_WORDS = ["assistant", "user", "system"]
"""Plain words of the chat template that the real (BPE) tokenizer gives one id each."""
TEXT_VOCAB = 512
_TOKEN_ID = {token: 256 + i for i, token in enumerate(_SPECIAL + _TEMPLATE_WORDS)}

# Real names and codec ids of the CustomVoice checkpoint's tables (a subset).
SPEAKERS = {"vivian": 3065, "serena": 3066, "ryan": 3061, "aiden": 2861, "uncle_fu": 3010}
DEFAULT_SPEAKER = "vivian"
"""The first speaker of ``spk_id``, which vLLM-Omni's speech endpoint uses as its default."""
_LANGUAGES = {"chinese": 2055, "english": 2050, "german": 2053, "spanish": 2054, "japanese": 2058,
              "korean": 2064, "french": 2061, "russian": 2069, "italian": 2070, "portuguese": 2071}

_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def reference_frames(samples: int) -> int:
    """Reference codes the talker's encoder makes of ``samples`` samples at 24 kHz
    (``ceil(samples / 320)``, as ``_encode_ref_audio_batch`` cuts them)."""
    return -(-samples // ENCODE_DOWNSAMPLE)


def decoder_bytes_per_position_row() -> int:
    """K and V bytes of one position of one row across the decoder's layers:
    2 x layers x KV heads x head_dim x dtype size (from the constants, never measured)."""
    element = torch.empty((), dtype=DECODER_DTYPE).element_size()
    return 2 * DECODER_LAYERS * DECODER_KV_HEADS * DECODER_HEAD_DIM * element


def _config(tts_model_type: str | None) -> dict:
    talker = {
        "model_type": "qwen3_tts_talker",
        "vocab_size": TALKER_VOCAB,
        "hidden_size": TALKER_HIDDEN,
        "intermediate_size": TALKER_INTERMEDIATE,
        "num_hidden_layers": TALKER_LAYERS,
        "num_attention_heads": TALKER_HEADS,
        "num_key_value_heads": TALKER_KV_HEADS,
        "head_dim": TALKER_HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        # The real talker's interleaved M-RoPE; sections sum to head_dim / 2.
        "rope_scaling": {"interleaved": True, "mrope_section": [6, 5, 5], "rope_type": "default"},
        "attention_bias": False,
        "num_code_groups": NUM_CODE_GROUPS,
        "text_vocab_size": TEXT_VOCAB,
        "text_hidden_size": TALKER_HIDDEN,
        "position_id_per_seconds": 13,
        "codec_bos_id": 2149,
        "codec_eos_token_id": CODEC_EOS,
        "codec_pad_id": 2148,
        "codec_think_id": 2154,
        "codec_nothink_id": 2155,
        "codec_think_bos_id": 2156,
        "codec_think_eos_id": 2157,
        "codec_language_id": dict(_LANGUAGES),
        # A Base checkpoint ships an empty speaker table.
        "spk_id": {} if tts_model_type == "base" else dict(SPEAKERS),
        "spk_is_dialect": {} if tts_model_type == "base" else {name: False for name in SPEAKERS},
        "code_predictor_config": {
            "model_type": "qwen3_tts_talker_code_predictor",
            "vocab_size": CODEBOOK_SIZE,
            "hidden_size": TALKER_HIDDEN,
            "intermediate_size": TALKER_INTERMEDIATE,
            "num_hidden_layers": CODE_PREDICTOR_LAYERS,
            "num_attention_heads": TALKER_HEADS,
            "num_key_value_heads": TALKER_KV_HEADS,
            "head_dim": TALKER_HEAD_DIM,
            "hidden_act": "silu",
            "max_position_embeddings": 65536,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000,
            "num_code_groups": NUM_CODE_GROUPS,
            "layer_types": ["full_attention"] * CODE_PREDICTOR_LAYERS,
        },
    }
    config = {
        "architectures": ["Qwen3TTSForConditionalGeneration"],
        "model_type": "qwen3_tts",
        "tokenizer_type": "qwen3_tts_tokenizer_12hz",
        "tts_model_size": "0b6",
        "tts_model_type": tts_model_type,
        "torch_dtype": "bfloat16",
        "im_start_token_id": _TOKEN_ID["<|im_start|>"],
        "im_end_token_id": _TOKEN_ID["<|im_end|>"],
        "tts_pad_token_id": _TOKEN_ID["<|tts_pad|>"],
        "tts_bos_token_id": _TOKEN_ID["<|tts_text_bos|>"],
        "tts_eos_token_id": _TOKEN_ID["<|tts_text_eod|>"],
        "assistant_token_id": _TOKEN_ID["assistant"],
        "talker_config": talker,
        "speaker_encoder_config": dict(_SPEAKER_ENCODER_CONFIG),
    }
    if tts_model_type is None:
        del config["tts_model_type"]
    return config


def _write_tokenizer(directory: Path) -> None:
    """A byte-level BPE (no merges: one token per byte) with the special and
    template tokens as added tokens, saved as ``tokenizer.json``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    byte_chars = _byte_level_chars()
    if set(byte_chars) != set(pre_tokenizers.ByteLevel.alphabet()):
        raise AssertionError("byte-level alphabet differs from tokenizers' own")
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _SPECIAL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in _TEMPLATE_WORDS])
    for token, expected in _TOKEN_ID.items():
        if tokenizer.token_to_id(token) != expected:
            raise AssertionError(f"tokenizer id of {token!r} is {tokenizer.token_to_id(token)}, not {expected}")
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 32768,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "chat_template": _CHAT_TEMPLATE,
    }, indent=2))
    (directory / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=2))


def _byte_level_chars() -> list[str]:
    """GPT-2's byte-level alphabet, in byte order (the character standing for byte 0, 1, ...)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _talker_weights(generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Random talker weights under the real checkpoint's names (bfloat16, as it ships)."""
    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    def zeros(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.bfloat16)

    def layers(prefix: str, count: int) -> dict[str, torch.Tensor]:
        out = {}
        q, kv = TALKER_HEADS * TALKER_HEAD_DIM, TALKER_KV_HEADS * TALKER_HEAD_DIM
        for i in range(count):
            p = f"{prefix}.layers.{i}"
            out.update({
                f"{p}.input_layernorm.weight": ones(TALKER_HIDDEN),
                f"{p}.post_attention_layernorm.weight": ones(TALKER_HIDDEN),
                f"{p}.self_attn.q_proj.weight": normal(q, TALKER_HIDDEN),
                f"{p}.self_attn.k_proj.weight": normal(kv, TALKER_HIDDEN),
                f"{p}.self_attn.v_proj.weight": normal(kv, TALKER_HIDDEN),
                f"{p}.self_attn.o_proj.weight": normal(TALKER_HIDDEN, q),
                f"{p}.self_attn.q_norm.weight": ones(TALKER_HEAD_DIM),
                f"{p}.self_attn.k_norm.weight": ones(TALKER_HEAD_DIM),
                f"{p}.mlp.gate_proj.weight": normal(TALKER_INTERMEDIATE, TALKER_HIDDEN),
                f"{p}.mlp.up_proj.weight": normal(TALKER_INTERMEDIATE, TALKER_HIDDEN),
                f"{p}.mlp.down_proj.weight": normal(TALKER_HIDDEN, TALKER_INTERMEDIATE),
            })
        out[f"{prefix}.norm.weight"] = ones(TALKER_HIDDEN)
        return out

    weights = {
        "talker.model.codec_embedding.weight": normal(TALKER_VOCAB, TALKER_HIDDEN),
        "talker.model.text_embedding.weight": normal(TEXT_VOCAB, TALKER_HIDDEN),
        "talker.text_projection.linear_fc1.weight": normal(TALKER_HIDDEN, TALKER_HIDDEN),
        "talker.text_projection.linear_fc1.bias": zeros(TALKER_HIDDEN),
        "talker.text_projection.linear_fc2.weight": normal(TALKER_HIDDEN, TALKER_HIDDEN),
        "talker.text_projection.linear_fc2.bias": zeros(TALKER_HIDDEN),
        "talker.codec_head.weight": normal(TALKER_VOCAB, TALKER_HIDDEN),
        **layers("talker.model", TALKER_LAYERS),
        **layers("talker.code_predictor.model", CODE_PREDICTOR_LAYERS),
    }
    for g in range(NUM_CODE_GROUPS - 1):
        weights[f"talker.code_predictor.model.codec_embedding.{g}.weight"] = normal(CODEBOOK_SIZE, TALKER_HIDDEN)
        weights[f"talker.code_predictor.lm_head.{g}.weight"] = normal(CODEBOOK_SIZE, TALKER_HIDDEN)
    # End of speech as soon as the sampler allows it (module docstring).
    weights["talker.model.codec_embedding.weight"][:, EOS_CHANNEL] = 1.0
    weights["talker.codec_head.weight"][CODEC_EOS, EOS_CHANNEL] = EOS_WEIGHT
    return weights


def _speaker_encoder_weights() -> dict[str, torch.Tensor]:
    """vLLM-Omni's own ECAPA-TDNN speaker encoder, built small and seeded (bfloat16, as a Base checkpoint ships it)."""
    from vllm_omni.model_executor.models.qwen3_tts.configuration_qwen3_tts import Qwen3TTSSpeakerEncoderConfig
    from vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_talker import Qwen3TTSSpeakerEncoder

    torch.manual_seed(SEED + 2)
    encoder = Qwen3TTSSpeakerEncoder(Qwen3TTSSpeakerEncoderConfig(**_SPEAKER_ENCODER_CONFIG))
    return {f"speaker_encoder.{k}": v.detach().to(torch.bfloat16).contiguous().clone()
            for k, v in encoder.state_dict().items()}


def _write_speech_tokenizer(directory: Path) -> None:
    """vLLM-Omni's own tokenizer config, encoder and decoder, built small and saved."""
    from safetensors.torch import save_file
    from vllm_omni.model_executor.models.qwen3_tts.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import (
        Qwen3TTSTokenizerV2Config,
    )
    from vllm_omni.model_executor.models.qwen3_tts.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import (
        Qwen3TTSTokenizerV2Decoder,
        Qwen3TTSTokenizerV2Encoder,
    )

    directory.mkdir(parents=True, exist_ok=True)
    config = Qwen3TTSTokenizerV2Config(
        encoder_config=dict(_ENCODER_CONFIG),
        decoder_config=dict(_DECODER_CONFIG),
        encoder_valid_num_quantizers=NUM_CODE_GROUPS,
        input_sample_rate=OUTPUT_SAMPLE_RATE,
        output_sample_rate=OUTPUT_SAMPLE_RATE,
        decode_upsample_rate=SAMPLES_PER_FRAME,
        encode_downsample_rate=ENCODE_DOWNSAMPLE,
    )
    config.save_pretrained(str(directory))
    (directory / "preprocessor_config.json").write_text(json.dumps({
        "feature_extractor_type": "EncodecFeatureExtractor",
        "feature_size": 1,
        "sampling_rate": OUTPUT_SAMPLE_RATE,
        "padding_side": "right",
        "padding_value": 0.0,
        "return_attention_mask": True,
        "chunk_length_s": None,
        "overlap": None,
    }, indent=2))
    torch.manual_seed(SEED)
    encoder = Qwen3TTSTokenizerV2Encoder._from_config(config.encoder_config)
    # Mimi's codebooks start as zeros (every frame would quantise to code 0):
    # seeded centroids instead, as a trained codebook has distinct ones.
    codebooks = torch.Generator().manual_seed(SEED + 3)
    for name, buffer in sorted(encoder.named_buffers()):
        if name.endswith(".embed_sum"):
            buffer.copy_(torch.randn(buffer.shape, generator=codebooks))
    torch.manual_seed(SEED + 1)
    decoder = Qwen3TTSTokenizerV2Decoder._from_config(config.decoder_config)
    state = {f"encoder.{k}": v.detach().contiguous().clone() for k, v in encoder.state_dict().items()}
    state.update({f"decoder.{k}": v.detach().contiguous().clone() for k, v in decoder.state_dict().items()})
    save_file(state, str(directory / "model.safetensors"))


def write_qwen3_tts_checkpoint(directory: str | Path, *, tts_model_type: str | None = None) -> Path:
    """Write the checkpoint into ``directory`` (created); returns its path.

    ``tts_model_type``: None (default) leaves the field out, so vLLM-Omni's
    speech endpoint serves preset voices and voice clones from the one
    checkpoint (speaker table and speaker-encoder weights both present;
    no component of ``directory`` may then end in ``base``, ``customvoice``
    or ``voicedesign``, which that endpoint would read as the task);
    ``"custom_voice"`` writes a CustomVoice checkpoint (speaker table, no
    speaker-encoder weights); ``"base"`` a Base one (empty speaker table,
    speaker-encoder weights). Only the endpoint's admission differs: the
    talker, code predictor, tokenizers and decoder are byte-identical."""
    from safetensors.torch import save_file

    if tts_model_type not in TTS_MODEL_TYPES:
        raise ValueError(f"tts_model_type must be one of {TTS_MODEL_TYPES}, not {tts_model_type!r}")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(_config(tts_model_type), indent=2))
    (root / "generation_config.json").write_text(json.dumps({"do_sample": True}, indent=2))
    _write_tokenizer(root)
    generator = torch.Generator().manual_seed(SEED)
    weights = _talker_weights(generator)
    if tts_model_type != "custom_voice":
        weights.update(_speaker_encoder_weights())
    save_file(weights, str(root / "model.safetensors"), metadata={"format": "pt"})
    _write_speech_tokenizer(root / "speech_tokenizer")
    return root


if __name__ == "__main__":
    import sys

    print(write_qwen3_tts_checkpoint(sys.argv[1] if len(sys.argv) > 1 else "qwen3-tts-small",
                                     tts_model_type=sys.argv[2] if len(sys.argv) > 2 else None))
