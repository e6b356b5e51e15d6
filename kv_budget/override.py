"""Operator corrections to declarations, applied before planning.

A declaration is written by a model's author and shipped inside the model's
code. When it is wrong (vLLM-Omni's Qwen3-TTS declares ``sliding_window - 1``
positions where transformers keeps ``sliding_window`` alive; MiniCPM-o
declares one streaming session where its deploy file allows four), the
operator must be able to correct it without patching the model. An override
names one declaration by the owner path and name the collector reports, and
one field::

    OWNER/NAME:FIELD=VALUE
    decoder/codec_decoder_request:physical_capacity_positions=72
    thinker.apm/whisper_encoder_self_attn:rows_fixed=4

``OWNER`` is empty or ``<root>`` for a declaration made by the root module.
In a vLLM-Omni deployment an override may name its stage first,
``STAGE:OWNER/NAME:FIELD=VALUE`` (``1:decoder/codec_decoder_request:...``):
it applies in that stage only. An unqualified one applies in every stage
that has the declaration.
Overrides apply in the order given; the corrected declaration is validated
again (``rows=fixed`` still needs ``rows_fixed`` and ``rows_reason``), and
every overridden field keeps its declared value beside the applied one, so
the plan shows both. An override that matches no declaration is an error
naming the declarations that exist: a silently ignored correction is a
typo that leaves the server unprotected.

Entry points: :func:`parse_override`, :func:`apply_overrides`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kv_budget.collect.model import Collection, OwnedSpec
from kv_budget.collect.specfile import parse_dtype
from kv_budget.declare.spec import InvalidDeclarationError, ModelLocalKVSpec, RowDriver, Scope
from kv_budget.errors import KvBudgetError
from kv_budget.units import parse_positive_int

__all__ = [
    "OverrideError",
    "Override",
    "OVERRIDABLE_FIELDS",
    "ROOT_OWNER",
    "parse_override",
    "parse_overrides",
    "overrides_for_stage",
    "apply_overrides",
    "unmatched_message",
    "declaration_label",
]

ROOT_OWNER = "<root>"
"""How the root module's path ("") is written in an override and a report."""


class OverrideError(KvBudgetError, ValueError):
    """An override that cannot be read or applied; the message names it."""


_STAGE_PREFIX = re.compile(r"^\s*(\d+)\s*:(.*)$", re.DOTALL)
"""``STAGE:`` before an override. An owner path never starts with digits
and a colon (``0/name`` is a root ModuleList child, with a slash)."""


def _choice(enum_cls: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return enum_cls(text)
        except ValueError:
            raise ValueError(f"{text!r} is not one of {[m.value for m in enum_cls]}") from None

    return parse


def _text(text: str) -> str:
    return text


OVERRIDABLE_FIELDS: dict[str, Callable[[str], Any]] = {
    "layers": parse_positive_int,
    "kv_heads": parse_positive_int,
    "head_dim": parse_positive_int,
    "dtype": parse_dtype,
    "physical_capacity_positions": parse_positive_int,
    "capacity_source": _text,
    "scope": _choice(Scope),
    "rows": _choice(RowDriver),
    "rows_fixed": parse_positive_int,
    "rows_reason": _text,
}
"""Field -> parser of its VALUE. ``name`` is not here: it is how the
declaration is found. ``allocation_note`` is not: it changes no byte."""


@dataclass(frozen=True)
class Override:
    """One parsed ``[STAGE:]OWNER/NAME:FIELD=VALUE``."""

    owner: str
    """Collector path; "" for the root."""
    name: str
    field: str
    value: Any
    text: str
    """As the operator wrote it, for messages."""
    stage: int | None = None
    """The vLLM-Omni stage it is for; None: every stage that has the declaration."""


def parse_override(text: Any) -> Override:
    """Read ``OWNER/NAME:FIELD=VALUE``; raise :class:`OverrideError` saying
    which part is wrong and what was expected."""
    expected = ("expected [STAGE:]OWNER/NAME:FIELD=VALUE, "
                "e.g. decoder/codec_decoder_request:physical_capacity_positions=72")
    if not isinstance(text, str):
        raise OverrideError(f"override {text!r} is not a string; {expected}")
    qualified = _STAGE_PREFIX.match(text)
    stage = int(qualified.group(1)) if qualified else None
    target, colon, assignment = (qualified.group(2) if qualified else text).partition(":")
    field, equals, raw = assignment.partition("=")
    owner, slash, name = target.rpartition("/")
    if not (colon and equals and slash) or not name.strip():
        raise OverrideError(f"override {text!r}: {expected}")
    field = field.strip()
    if field not in OVERRIDABLE_FIELDS:
        raise OverrideError(
            f"override {text!r}: field {field!r} cannot be overridden; choose from {sorted(OVERRIDABLE_FIELDS)}"
        )
    owner = owner.strip()
    try:
        value = OVERRIDABLE_FIELDS[field](raw.strip())
    except ValueError as exc:
        raise OverrideError(f"override {text!r}: {field}: {exc}") from None
    return Override(
        owner="" if owner == ROOT_OWNER else owner, name=name.strip(), field=field, value=value, text=text, stage=stage
    )


def parse_overrides(texts: Iterable[Any]) -> list[Override]:
    return [parse_override(text) for text in texts]


def overrides_for_stage(overrides: Sequence[Override], stage_id: int | None) -> list[Override]:
    """The overrides that apply in stage ``stage_id`` (unqualified ones and
    its own). Outside vLLM-Omni (``stage_id`` None) a stage-qualified
    override raises: there is no stage for it to apply to."""
    if stage_id is None:
        qualified = [o.text for o in overrides if o.stage is not None]
        if qualified:
            raise OverrideError(
                f"override(s) {', '.join(map(repr, qualified))} name a vLLM-Omni stage, but this engine is not a "
                "vLLM-Omni stage; drop the STAGE: prefix"
            )
        return list(overrides)
    return [o for o in overrides if o.stage is None or o.stage == stage_id]


def declaration_label(owner: str, name: str) -> str:
    return f"{owner or ROOT_OWNER}/{name}"


def _json_value(value: Any) -> Any:
    """A field value as the plan's JSON shows it."""
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, (Scope, RowDriver)):
        return value.value
    return value


def _apply_to(owned: OwnedSpec, overrides: Sequence[Override]) -> OwnedSpec:
    spec = owned.spec
    changes = {change[0]: change for change in owned.overridden}
    values = {f.name: getattr(spec, f.name) for f in dataclasses.fields(ModelLocalKVSpec)}
    for override in overrides:
        declared = changes[override.field][1] if override.field in changes else values[override.field]
        values[override.field] = override.value
        changes[override.field] = (override.field, _json_value(declared), _json_value(override.value))
    try:
        corrected = ModelLocalKVSpec(**values)
    except InvalidDeclarationError as exc:
        texts = ", ".join(o.text for o in overrides)
        raise OverrideError(f"after override(s) {texts}: {exc}") from None
    return dataclasses.replace(owned, spec=corrected, overridden=tuple(changes.values()))


def apply_overrides(collection: Collection, overrides: Sequence[Override]) -> tuple[Collection, list[Override]]:
    """The collection with ``overrides`` applied in order, and the overrides
    that matched no declaration in it (the caller decides: the ``plan``
    command refuses at once; the engine refuses an override that matches on
    no worker, since tensor-parallel ranks may declare differently). Raises
    :class:`OverrideError` when a corrected declaration is invalid."""
    matched: set[int] = set()
    specs: list[OwnedSpec] = []
    for owned in collection.specs:
        mine = [o for o in overrides if o.owner == owned.owner and o.name == owned.spec.name]
        matched.update(id(o) for o in mine)
        specs.append(_apply_to(owned, mine) if mine else owned)
    unmatched = [o for o in overrides if id(o) not in matched]
    return Collection(tuple(specs), collection.failures), unmatched


def unmatched_message(unmatched: Sequence[Override], available: Iterable[str]) -> str:
    """Why an override is refused: it names no declaration; here are those
    that exist."""
    names = sorted(set(available))
    return (
        f"model-local KV override(s) {', '.join(repr(o.text) for o in unmatched)} match no declaration; "
        f"declarations: {', '.join(names) if names else 'none (the model declares nothing)'}"
    )
