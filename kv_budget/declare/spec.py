"""How a model declares the attention KV it keeps outside vLLM's paged KV pool.

vLLM sizes its paged KV pool from a profiling run at startup. A model that
keeps ``transformers`` cache objects of its own (a codec decoder's sliding
window, a local transformer, a streaming encoder, a talker's static cache)
allocates that memory per request, after profiling, where no startup figure
sees it. Only the model knows how big those caches are and what multiplies
them: each one is bounded by something different (a sliding window, a decode
loop's trip count, an encoder's frame limit, a hard-coded constant) and none
by ``max_model_len``. So the model declares; kv-budget plans.

A declaration describes one allocation *lifetime*. It never allocates.

vLLM-Omni (0.30 and later) ships a declaration module of its own and
declarers that use it; kv-budget takes their declarations exactly as they
are made. So the names, field order, defaults and documented semantics here
are vLLM-Omni's: ``ModelLocalKVSpec``, ``ModelLocalKVScope``, ``RowDriver``
and ``HasModelLocalKV`` can replace its imports unchanged, and
:func:`normalize_spec` reads a declaration object of vLLM-Omni's own class
(or any class with the same attribute names) by the same rules, including
its default ``rows_fixed=1``, documented as ignored beside
``rows=max_num_seqs``. A refusal drops bytes from the plan, so this module
refuses only what vLLM-Omni refuses too (a fixed count below 1 or without a
reason) and what makes the byte count impossible to compute (geometry that
is not a positive int, a dtype that is not a ``torch.dtype``, an unknown
scope or row driver), and always says why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol, runtime_checkable

import torch

from kv_budget.errors import KvBudgetError

__all__ = [
    "Scope",
    "ModelLocalKVScope",
    "RowDriver",
    "ModelLocalKVSpec",
    "InvalidDeclarationError",
    "SPEC_FIELDS",
    "OPTIONAL_SPEC_FIELDS",
    "HasModelLocalKV",
    "normalize_spec",
]


class Scope(str, Enum):
    """How long one allocation lives.

    The planner only needs to know one thing from it: was the memory already
    resident when the device was sampled? ``model`` caches were (they were
    made during load or CUDA-graph capture, before the sample), so they are
    reported but never subtracted again. Every other scope appears after
    startup and is what the headroom must absorb.
    """

    INVOCATION = "invocation"
    """Dies when the call returns, e.g. a per-step working copy of a cache."""

    REQUEST = "request"
    """Retained across the steps of one request, freed when it finishes."""

    SESSION = "session"
    """Retained across requests of one streaming session."""

    MODEL = "model"
    """Lives as long as the model, e.g. captured into a CUDA-graph pool."""


ModelLocalKVScope = Scope
"""vLLM-Omni's name for :class:`Scope` (same values), so its declarers can
import it from here."""



class RowDriver(str, Enum):
    """What multiplies one row of a declaration at peak.

    Kept separate from :class:`Scope`: a short-lived working copy still
    exists once per running sequence, and a long-lived graph pool has a fixed
    number of rows set by the captured shapes.
    """

    FIXED = "fixed"
    """A count the model knows (``rows_fixed``), e.g. captured graph buckets."""

    MAX_NUM_SEQS = "max_num_seqs"
    """One row per sequence the scheduler may run at once."""


class InvalidDeclarationError(KvBudgetError, ValueError):
    """A declaration that cannot be believed.

    The message always names the declaration, the field and the value, so
    the model author can find the line without a debugger.
    """


def _dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _enum_value(enum_cls: type[Enum], value: Any) -> Enum | None:
    """Accept our enum, another library's enum with the same values, or the
    lowercase string value; anything else is ``None`` (invalid)."""
    if isinstance(value, enum_cls):
        return value
    raw = value.value if isinstance(value, Enum) else value
    if isinstance(raw, str):
        try:
            return enum_cls(raw)
        except ValueError:
            return None
    return None


@dataclass(frozen=True)
class ModelLocalKVSpec:
    """One allocation of model-local attention KV, described, not allocated.

    Fields in vLLM-Omni's order, positional or keyword, with its defaults: a
    declarer written against vLLM-Omni's class must build this one unchanged.
    Write them as keywords anyway: a swapped ``kv_heads``/``head_dim`` gives
    the same product while lying about the geometry.
    """

    name: str
    """Short id of the allocation, unique within its owner."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    """Geometry of one row. ``dtype`` is a real ``torch.dtype``: a string such
    as ``"half"`` is ambiguous across libraries, so only the file loader,
    which documents its spelling, converts strings."""

    physical_capacity_positions: int
    """Positions the tensor can physically hold, not the logical position a
    sequence reaches. A sliding window of W keeps W - 1 past positions; a
    StaticCache holds its whole preallocation whatever was used."""

    capacity_source: str
    """Where the bound comes from, for humans ("sliding_window - 1"). Never
    branched on: it exists so a reviewer can check the number. Any string,
    empty included, as in vLLM-Omni: refusing a declaration over its
    commentary would drop its bytes from the plan."""

    scope: Scope
    rows: RowDriver
    rows_fixed: int = 1
    """The row count when ``rows`` is fixed; ignored when it is
    ``max_num_seqs`` (vLLM-Omni's default and documented meaning: every
    per-sequence declaration it makes carries ``rows_fixed=1``)."""

    rows_reason: str = ""
    """Why ``rows_fixed`` is that number; required when ``rows`` is fixed. A
    fixed count with no reason was the commonest way a declaration went
    stale. Ignored when ``rows`` is ``max_num_seqs``."""

    allocation_note: str | None = None
    """Optional free text on layout (e.g. "one cache per captured bucket")."""

    def __post_init__(self) -> None:
        fail = self._fail
        if not isinstance(self.name, str) or not self.name.strip():
            raise InvalidDeclarationError(
                f"declaration {self.name!r}: field 'name' = {self.name!r} is invalid: "
                "expected a non-empty string"
            )
        for field in ("layers", "kv_heads", "head_dim", "physical_capacity_positions"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                fail(field, value, "expected an int >= 1")
        if not isinstance(self.dtype, torch.dtype):
            fail("dtype", self.dtype, "expected a torch.dtype such as torch.bfloat16")
        if not isinstance(self.capacity_source, str):
            fail("capacity_source", self.capacity_source, "expected a string saying where the bound comes from")
        scope = _enum_value(Scope, self.scope)
        if scope is None:
            fail("scope", self.scope, f"expected one of {[s.value for s in Scope]}")
        object.__setattr__(self, "scope", scope)
        rows = _enum_value(RowDriver, self.rows)
        if rows is None:
            fail("rows", self.rows, f"expected one of {[r.value for r in RowDriver]}")
        object.__setattr__(self, "rows", rows)
        if rows is RowDriver.FIXED:
            count = self.rows_fixed
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                fail("rows_fixed", count, "rows='fixed' needs an int count >= 1")
            if not isinstance(self.rows_reason, str) or not self.rows_reason.strip():
                fail("rows_reason", self.rows_reason, "rows='fixed' needs a reason for the count")
        if self.allocation_note is not None and not isinstance(self.allocation_note, str):
            fail("allocation_note", self.allocation_note, "expected a string or None")

    def _fail(self, field: str, value: Any, why: str) -> None:
        raise InvalidDeclarationError(
            f"declaration {self.name!r}: field {field!r} = {value!r} is invalid: {why}"
        )

    @property
    def dtype_bytes(self) -> int:
        return _dtype_size(self.dtype)

    @property
    def bytes_per_row(self) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x positions x dtype size."""
        return (
            2
            * self.layers
            * self.kv_heads
            * self.head_dim
            * self.physical_capacity_positions
            * self.dtype_bytes
        )

    def row_count(self, max_num_seqs: int = 1) -> int:
        """Rows alive at peak: the fixed count, or the engine's
        ``max_num_seqs`` (at least 1, as vLLM-Omni counts it)."""
        if self.rows is RowDriver.FIXED:
            return self.rows_fixed
        return max(1, max_num_seqs)

    def peak_bytes(self, max_num_seqs: int = 1) -> int:
        """Bytes at peak once the engine's ``max_num_seqs`` is known."""
        return self.bytes_per_row * self.row_count(max_num_seqs)


SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(ModelLocalKVSpec))
"""The contract's attribute names, in declaration order."""

OPTIONAL_SPEC_FIELDS = frozenset({"rows_fixed", "rows_reason", "allocation_note"})
"""Fields a declaration may leave out (they have vLLM-Omni's defaults);
every other one is required."""


def normalize_spec(obj: Any) -> ModelLocalKVSpec:
    """Turn a declaration of any class with the contract's attribute names
    into a validated :class:`ModelLocalKVSpec`.

    vLLM-Omni ships declarers whose objects are not ours; they must be taken
    as they are, by vLLM-Omni's rules (see the module docstring): an optional
    field that is absent gets vLLM-Omni's default, ``rows_fixed`` and
    ``rows_reason`` beside ``rows=max_num_seqs`` are ignored. A missing
    required attribute is an error, not a default.
    """
    if isinstance(obj, ModelLocalKVSpec):
        return obj
    label = getattr(obj, "name", None)
    values: dict[str, Any] = {}
    for field in SPEC_FIELDS:
        if hasattr(obj, field):
            values[field] = getattr(obj, field)
        elif field not in OPTIONAL_SPEC_FIELDS:
            raise InvalidDeclarationError(
                f"declaration {label!r} ({type(obj).__name__}): required field "
                f"{field!r} is missing"
            )
    return ModelLocalKVSpec(**values)


@runtime_checkable
class HasModelLocalKV(Protocol):
    """Implemented by whichever object owns a cache, usually a module several
    levels below the model vLLM loaded. Returning an empty sequence is valid
    and is what a code path that allocates nothing must return."""

    def model_local_kv_specs(self) -> Sequence[Any]: ...
