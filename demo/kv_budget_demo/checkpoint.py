"""The demo checkpoint, written offline: config, random weights, tokenizer.

The demo architecture (``KvBudgetDemoForCausalLM``, registered by the vLLM
plugin) is a small Qwen2 causal LM plus a "talker" that keeps real
``transformers`` cache rows for the sequences in flight. Its geometry lives
in the config under :data:`TALKER_KEY`, the one place both the allocation and
the declaration read it from, so the two cannot drift.

``python -m kv_budget_demo.checkpoint DIR`` writes one from the shell.

No hub access exists where this runs: weights are random (seeded) and the
tokenizer is a byte-level BPE trained here with the ``tokenizers`` library.
A word-level tokenizer does not work: transformers 5 loads a ``qwen2``
model's tokenizer as byte-level BPE and would encode every prompt to [].
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

__all__ = ["ARCHITECTURE", "TALKER_KEY", "DEFAULT_TALKER", "LIFETIMES", "talker_bytes_per_row", "write_demo_checkpoint"]

ARCHITECTURE = "KvBudgetDemoForCausalLM"
TALKER_KEY = "kv_budget_talker"

DEFAULT_TALKER = {
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_size": 256,
    "positions": 256,
    "postnet_positions": 64,
    "dtype": "float32",
    "declarer_raises": False,
    "lifetime": "step",
    "declared_positions": None,
    "frees_finished": True,
    "allocates": True,
}
"""Talker geometry: 2 x 4 layers x 2 kv heads x 64 head_dim x 256 positions x
4 B = 1 MiB per sequence, plus a one-layer postnet cache of 64 positions
(64 KiB per sequence) kept by the last tensor-parallel rank only. Large
enough that 256 sequences (272 MiB) visibly exceed a small headroom, small
enough to allocate every step on a CPU. ``declarer_raises`` makes the
talker's declarer raise, to show that a broken declarer does not stop the
engine.

The switches that make a declaration wrong, for the live checks:

* ``lifetime``: ``"step"`` builds the rows each forward step and frees them
  on return (scope ``invocation``); ``"request"`` keeps one row per request
  from its first step until vLLM reports it finished (scope ``request``),
  as vLLM-Omni's talkers and codec decoders do. Only retained rows can be
  seen by a sample between steps.
* ``declared_positions``: declare this many positions for the talker cache
  while allocating ``positions`` (an under-declaration); None declares the truth.
* ``frees_finished``: False keeps a finished request's rows (a leak).
* ``allocates``: False declares the cache and never builds it (a dead
  declaration)."""

LIFETIMES = ("step", "request")

VOCAB = 512
_SYLLABLES = ["ka", "to", "ri", "mo", "su", "ne", "la", "pi", "do", "ve", "zu", "ha"]


def talker_bytes_per_row(talker: dict, tp_size: int = 1, last_rank: bool = True, declared: bool = False) -> int:
    """Bytes one sequence's talker rows take on one rank, by hand: the
    figure a plan must reproduce (``declared=True``: what the talker
    declares, which ``declared_positions`` can make short). The talker's kv
    heads are sharded across tensor-parallel ranks; the postnet lives on the
    last rank only."""
    dtype_bytes = torch.empty((), dtype=getattr(torch, talker["dtype"])).element_size()
    head_dim = talker["hidden_size"] // talker["num_attention_heads"]
    kv_heads = talker["num_key_value_heads"] // tp_size
    positions = talker["positions"]
    if declared and talker.get("declared_positions") is not None:
        positions = talker["declared_positions"]
    main = 2 * talker["num_hidden_layers"] * kv_heads * head_dim * positions * dtype_bytes
    postnet = 2 * 1 * talker["num_key_value_heads"] * head_dim * talker["postnet_positions"] * dtype_bytes
    return main + (postnet if last_rank else 0)


def _tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rnd = random.Random(0)
    corpus = [
        " ".join("".join(rnd.choice(_SYLLABLES) for _ in range(rnd.randint(1, 3))) for _ in range(20))
        for _ in range(2000)
    ]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 16,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=512,
    )
    fast.save_pretrained(directory)


def write_demo_checkpoint(directory: str | Path, talker: dict | None = None, base_layers: int = 2) -> Path:
    """Write the checkpoint into ``directory`` (created) and return its path.

    ``talker`` overrides keys of :data:`DEFAULT_TALKER`; unknown keys raise.
    The base LM is Qwen2 with hidden 256, 4 heads, 2 kv heads (head_dim 64:
    vLLM's CPU attention rejects 16), ``base_layers`` layers. With 0 it has
    no attention layer, so vLLM sizes no paged KV pool for it: a pool-less
    engine, as vLLM-Omni's Qwen3-TTS code2wav stage is, whose talker still
    keeps (and declares) model-local KV.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    settings = dict(DEFAULT_TALKER)
    unknown = sorted(set(talker or {}) - set(settings))
    if unknown:
        raise ValueError(f"unknown talker key(s) {unknown}; known: {sorted(settings)}")
    settings.update(talker or {})
    if settings["lifetime"] not in LIFETIMES:
        raise ValueError(f"talker lifetime {settings['lifetime']!r}: choose from {list(LIFETIMES)}")
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    _tokenizer(path)
    eos = 0  # "<|endoftext|>" is the first special token
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=base_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
        architectures=[ARCHITECTURE],
        **{TALKER_KEY: settings},
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    config.architectures = [ARCHITECTURE]
    config.save_pretrained(path)
    return path


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m kv_budget_demo.checkpoint DIRECTORY")
    print(f"demo checkpoint written to {write_demo_checkpoint(sys.argv[1])}")
