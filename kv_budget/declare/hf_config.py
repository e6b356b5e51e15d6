"""Declaring from a Hugging Face config: :func:`spec_from_hf_config`.

A declarer that reads layers, KV heads and head size from the same config
its cache is built from cannot drift from the cache. Configs spell these
fields many ways (``num_hidden_layers``, ``n_layer``, ``decoder_layers``,
...) and nest a decoder and an encoder stack side by side; the lookup
tables below are vLLM-Omni's, so a declaration made here equals the one
vLLM-Omni's own helper makes. A field that no name finds raises: a guessed
geometry would be a wrong byte count.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from kv_budget.declare.spec import ModelLocalKVSpec, RowDriver, Scope

__all__ = ["spec_from_hf_config"]


_LOOKUP_NAMES = {
    "decoder": {
        "layers": ("decoder_layers", "num_decoder_layers", "num_hidden_layers", "n_layer", "num_layers", "n_layers"),
        "heads": ("decoder_attention_heads", "num_attention_heads", "n_head", "num_heads"),
        "kv_heads": ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num"),
        "hidden": ("hidden_size", "n_embd", "d_model"),
    },
    "encoder": {
        "layers": ("encoder_layers", "num_encoder_layers", "encoder_num_hidden_layers"),
        "heads": ("encoder_attention_heads", "encoder_num_attention_heads"),
        "kv_heads": ("encoder_num_key_value_heads",),
        "hidden": ("d_model", "encoder_hidden_size", "hidden_size"),
    },
}
"""Attribute names tried, in order, per stack. Decoder and encoder are asked
for explicitly: a Whisper config has both ``decoder_layers`` and
``encoder_layers``, and picking whichever is found first is a guess. The
stack-specific names come first, and generic names that the config's
``attribute_map`` aliases to the other stack are skipped: ``WhisperConfig``
maps ``num_hidden_layers`` and ``num_key_value_heads`` to the *encoder*, and
reading them declared the decoder with the encoder's geometry."""


def _lookup(config: Any, names: Iterable[str], stack: str) -> tuple[str, int] | None:
    """First integer attribute among ``names``, skipping generic names that
    the config's ``attribute_map`` aliases to the *other* stack (Whisper maps
    ``num_key_value_heads`` to ``encoder_attention_heads``)."""
    other = "decoder" if stack == "encoder" else "encoder"
    aliases = getattr(config, "attribute_map", None) or {}
    for attr in names:
        if str(aliases.get(attr, attr)).startswith(other):
            continue
        value = getattr(config, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return attr, value
    return None


_STACK_LAYER_NAMES = {
    "decoder": ("decoder_layers", "num_decoder_layers"),
    "encoder": _LOOKUP_NAMES["encoder"]["layers"],
}
"""Layer counts only a stack of that kind has: a config with both is an
encoder-decoder config, whose generic names could mean either stack."""


def _pick_stack(config: Any, name: str) -> str:
    """The stack to read when the caller named none: the decoder, unless
    the config has only an encoder. A config with both is refused: vLLM-Omni's
    own helper would read the encoder there (Whisper aliases the generic
    names to it) and a decoder-first lookup the decoder, and which one a
    declarer meant cannot be known."""
    has = {
        stack: _lookup(config, names, stack) is not None for stack, names in _STACK_LAYER_NAMES.items()
    }
    if has["decoder"] and has["encoder"]:
        raise ValueError(
            f"spec_from_hf_config({name!r}): {type(config).__name__} has an encoder and a decoder "
            "stack; pass stack='encoder' or stack='decoder' (or layers, kv_heads and head_dim)"
        )
    return "encoder" if has["encoder"] else "decoder"


def _geometry_from_config(config: Any, name: str, stack: str) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) looked up in ``config`` for ``stack``."""
    if stack not in _LOOKUP_NAMES:
        raise ValueError(f"stack {stack!r} is not one of {sorted(_LOOKUP_NAMES)}")
    names = _LOOKUP_NAMES[stack]
    kind = type(config).__name__

    def need(what: str) -> tuple[str, int]:
        found = _lookup(config, names[what], stack)
        if found is None:
            raise ValueError(
                f"spec_from_hf_config({name!r}): {kind} has no {stack} {what} count; "
                f"tried attributes {list(names[what])}"
            )
        return found

    _, layers = need("layers")
    _, heads = need("heads")
    kv_found = _lookup(config, names["kv_heads"], stack)
    if kv_found is not None:
        kv_heads = kv_found[1]
    elif getattr(config, "multi_query", False) is True:
        kv_heads = 1
    else:
        kv_heads = heads
    head_dim = getattr(config, "head_dim", None) if stack == "decoder" else None
    if not isinstance(head_dim, int) or isinstance(head_dim, bool):
        hidden_attr, hidden = need("hidden")
        if heads < 1 or hidden % heads:
            raise ValueError(
                f"spec_from_hf_config({name!r}): {kind}.{hidden_attr}={hidden} is not "
                f"divisible by {heads} heads and the config has no head_dim"
            )
        head_dim = hidden // heads
    return layers, kv_heads, head_dim


def spec_from_hf_config(
    config: Any,
    *,
    name: str,
    physical_capacity_positions: int,
    capacity_source: str,
    scope: Scope | str,
    dtype: torch.dtype,
    rows: RowDriver | str,
    rows_fixed: int = 1,
    rows_reason: str = "",
    allocation_note: str | None = None,
    layers: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    stack: str | None = None,
) -> ModelLocalKVSpec:
    """Build a declaration from the same Hugging Face config the cache is
    built from, so the two cannot drift apart.

    vLLM-Omni's signature, plus ``stack``. ``rows`` is keyword-required: the
    multiplicity is the part most often wrong, and a default would hide that
    nobody thought about it. ``layers``, ``kv_heads`` and ``head_dim``, when
    given, are used as given (a declarer may know the built module better
    than the config); the others are looked up under the usual attribute
    names of the ``stack`` ("decoder" or "encoder"; by default the decoder,
    or the encoder of an encoder-only config, and refused for a config that
    has both). ``head_dim`` is the config's own when it has one, else
    hidden / heads, which must divide exactly. With no key/value head count
    in the config, attention is multi-head (kv heads == heads), except that
    ``multi_query=True`` means one. Anything not found raises, naming every
    attribute tried.
    """
    if layers is None or kv_heads is None or head_dim is None:
        found = _geometry_from_config(config, name, stack or _pick_stack(config, name))
        layers = found[0] if layers is None else layers
        kv_heads = found[1] if kv_heads is None else kv_heads
        head_dim = found[2] if head_dim is None else head_dim
    return ModelLocalKVSpec(
        name=name,
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        physical_capacity_positions=physical_capacity_positions,
        capacity_source=capacity_source,
        scope=scope,  # type: ignore[arg-type]  # validated and converted in __post_init__
        rows=rows,  # type: ignore[arg-type]
        rows_fixed=rows_fixed,
        rows_reason=rows_reason,
        allocation_note=allocation_note,
    )
