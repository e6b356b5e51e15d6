"""Check declarations against the caches a model really holds.

A declaration (:mod:`kv_budget.declare.spec`) is a promise written by hand; the
planner believes it. If it is short, the planner admits more sequences than
fit and the server dies of out-of-memory long after a "successful" start. So
this module builds the model, lets it run, finds every ``transformers`` cache
object its modules keep, counts the bytes those caches really hold, and
compares them, owner by owner, with what the owner declared.

What is counted
    The *storage* behind each key/value tensor
    (``tensor.untyped_storage().nbytes()``), each storage once. A slice keeps
    its whole storage alive, and ``transformers`` 5.x slices: a
    ``DynamicSlidingWindowLayer`` with window W keeps a view of W - 1
    positions of the ``torch.cat`` result, so after a one-token decode step
    its storage holds W positions, and after a step of C tokens on a full
    window it holds W - 1 + C (after a P-token prefill, P). Counting the
    view's elements would report W - 1 and hide the difference. A
    ``copy.deepcopy`` copies the whole storage, so a working copy of a sliding
    cache also holds W positions. Only attention key/value state is counted:
    the small bookkeeping tensors of a layer (``cumulative_length``, the
    sliding-window scalar, a pending beam index) are not KV and no
    declaration can describe them. A layer that holds tensors under any other
    attribute, or a layer kind that holds no attention KV (linear-attention
    conv/recurrent state), is refused with :class:`UnsupportedCacheError`
    rather than half counted.

Where caches are found
    Each module of ``named_modules()`` (after the same ``unwrap()`` the
    collector does; a non-Module root is one owner, "") is an owner. Its
    instance attributes (``vars(module)`` minus ``_modules``, ``_parameters``
    and ``_buffers``) are searched for ``Cache`` objects, directly or inside
    lists, tuples, dicts and the attributes of plain objects, up to three
    levels (a dict of sessions, a dict of lists, a runtime helper's dict of
    session-state dataclasses: where vLLM-Omni's MiniCPM-o keeps each duplex
    session's encoder cache). Modules met on the way are not entered: they
    are owners of their own. A cache held by several owners is attributed once: to the single
    holder that declares something if exactly one does, else to the first
    holder in walk order. A cache whose holders all declare nothing goes to
    the single declaring module below its first holder, when there is exactly
    one: vLLM-Omni's Qwen3-TTS stage model keeps each request's decoder state
    (caches included) in a dict of its own while its ``decoder`` child
    declares them, and attributing by holder alone reported one cache twice,
    the stage model "undeclared" and the decoder "declared-but-absent". With
    no declaring module below, or several, the cache stays with its holder.
    A storage is counted once per report, for the first owner that reaches it.

The row-count rule (how declared bytes are computed "now")
    Declared bytes at the current rows = sum over the owner's declarations of
    ``bytes_per_row * rows``, where rows is ``rows_fixed`` for a ``fixed``
    declaration and, for a ``max_num_seqs`` declaration, the number of live
    sequences ``n``:

    * if ``audit_module(..., max_num_seqs=k)`` is given, ``n = k`` for every
      owner: the caller knows how many sequences its factory left live.
    * otherwise ``n`` is derived per owner. The rows of one cache are its
      batch dimension (a cache built for batch 4 holds 4 rows). The rows of
      one attribute are the summed rows of the caches in it (a dict of three
      batch-1 sessions holds 3). ``n`` is the smallest row count among the
      owner's attributes that hold any rows (0 if none does).

    Why the smallest: every per-sequence allocation lifetime (a retained
    cache, a per-call working copy) is kept in an attribute of its own and
    has one row per live sequence, so each such attribute shows ``n``; an
    attribute of a fixed pool shows its own count. Declared bytes only grow
    with ``n``, so taking the smallest candidate can only make a verdict
    louder (``under-declared``), never hide bytes. A missing allocation does
    not lower ``n`` (an attribute that is ``None`` holds no rows), so a
    declaration for a working copy that does not exist reads as
    ``over-declared``. Dividing total rows by the number of declarations
    instead would make exactly that mistake invisible. The rule cannot tell
    several copies kept in *one* container from more sequences: keep each
    lifetime in its own attribute, or pass ``max_num_seqs``.

Verdicts per owner
    ``match`` (declared == measured), ``under-declared`` (measured >
    declared: the dangerous one), ``over-declared`` (declared > measured,
    caches present), ``declared-but-absent`` (declarations, no live cache:
    e.g. the attribute is ``None`` or the model was not run),
    ``undeclared`` (caches held, nothing declared). Owners with neither are
    not listed. The audit measures what is live when it runs: a
    ``StaticCache`` allocates on its first forward, so run the model first.
"""

from __future__ import annotations

import importlib
import types
from typing import Any, Literal

import torch
from pydantic import BaseModel, computed_field
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    EncoderDecoderCache,
    LinearAttentionCacheLayerMixin,
    QuantizedLayer,
)

from kv_budget.collect import collect_model_local_kv_specs, unwrap_model, walk_modules
from kv_budget.declare.spec import ModelLocalKVSpec, RowDriver
from kv_budget.units import format_bytes

__all__ = [
    "AuditError",
    "UnsupportedCacheError",
    "LayerBytes",
    "CacheEntry",
    "DeclarationEntry",
    "FailureEntry",
    "OwnerAudit",
    "AuditReport",
    "Verdict",
    "measure_cache_bytes",
    "cache_breakdown",
    "audit_module",
    "HeldBytes",
    "load_factory",
]

Verdict = Literal["match", "under-declared", "over-declared", "declared-but-absent", "undeclared"]
"""The five outcomes of comparing one owner's declarations with its caches."""

_KV_ATTRIBUTES = ("keys", "values", "_quantized_keys", "_quantized_values", "indexer_keys")
"""Layer attributes that hold attention KV in transformers 5.x: full-precision
keys/values, a quantized layer's packed states, a sparse-attention indexer's
keys. Everything else a layer holds must be in :data:`_BOOKKEEPING_ATTRIBUTES`
or the layer is refused: an unknown tensor is either KV we would miss or
bookkeeping we would wrongly charge."""

_BOOKKEEPING_ATTRIBUTES = frozenset(
    {"cumulative_length", "_sliding_window_tensor", "indexer_cumulative_length", "_pending_beam_idx"}
)
"""Small tensors a layer keeps to track positions or a deferred beam order.
Not KV, not declarable; counting them (8 bytes per static layer) would make
no declaration ever match."""

_SKIPPED_MODULE_ATTRIBUTES = frozenset({"_modules", "_parameters", "_buffers"})
"""Children are owners of their own, and parameters and buffers are weights
the engine already counted at load; neither is a model-local cache."""

_CONTAINER_DEPTH = 3
"""How deep lists, tuples, dicts and plain objects are searched for caches:
a dict of sessions, a dict of lists, or vLLM-Omni's MiniCPM-o duplex runtime
(an object) -> its ``sessions`` dict -> a session-state dataclass -> the
cache. Two levels missed that last layout entirely: four sessions' caches
held while the audit reported the declaration absent and passed. Deeper
structures are rare, and searching arbitrary object graphs would find
caches that belong to someone else."""


class AuditError(ValueError):
    """The audit cannot compute an honest figure (e.g. the row count of a
    cache cannot be read) and says why instead of guessing."""


class UnsupportedCacheError(TypeError):
    """A cache or layer whose memory this module does not know how to count.
    Raised rather than counting part of it: a partial count reads as a
    smaller cache than the truth, which is the dangerous direction."""


class LayerBytes(BaseModel):
    """What one cache layer holds. ``bytes`` is storage not already counted
    for an earlier layer (or an earlier cache of the same report), so the
    per-layer figures add up to the cache total without double counting."""

    index: int
    """Layer position within its kind (self-attention and cross-attention
    each count from 0)."""
    kind: str
    """"self" or "cross": the two halves of an ``EncoderDecoderCache`` are
    declared from different positions (decoder tokens vs encoder frames)."""
    layer_class: str
    batch: int | None
    """Batch dimension of the keys (rows); None when the layer holds no 4-D
    keys to read it from (uninitialized, or a backend-packed layout)."""
    positions: int
    """Sequence dimension of the keys view (for a quantized layer, every
    token seen, quantized or not). A sliding view says W - 1 while its
    storage holds more: compare ``view_bytes`` and ``bytes``."""
    view_bytes: int
    """Bytes the held views address (elements x element size). Smaller than
    ``bytes`` when a slice keeps a larger storage alive."""
    bytes: int
    device: str | None
    """Where the storage lives: an offloaded layer on "cpu" does not use
    device memory, and the reader must be able to see that."""


class CacheEntry(BaseModel):
    """One live cache object found on an owner."""

    attribute: str
    """Top-level attribute name; the unit the row-count rule works on."""
    held_by: str
    """Module path of the holder; differs from the owner when the cache was
    attributed to a declaring module below it (see the module docstring)."""
    path: str
    """Where exactly it was found, e.g. ``sessions['a']`` or ``caches[0]``."""
    cache_class: str
    rows: int | None
    """Batch dimension (0 for a cache that holds nothing yet; None when it
    cannot be read)."""
    bytes: int
    layers: list[LayerBytes]


class DeclarationEntry(BaseModel):
    """One declaration and the rows it was charged at in this audit."""

    name: str
    scope: str
    rows_driver: str
    bytes_per_row: int
    rows: int
    bytes: int


class FailureEntry(BaseModel):
    """A declarer that raised or returned something unusable. Kept: a lost
    failure would read as an owner that holds nothing."""

    owner: str
    error: str


class OwnerAudit(BaseModel):
    """Declarations versus caches for one owner."""

    owner: str
    """Module path; "" is the root."""
    verdict: Verdict
    declarations: list[DeclarationEntry]
    declared_bytes: int
    measured_bytes: int
    live_sequences: int | None
    """``n`` charged to ``max_num_seqs`` declarations; None when the owner has
    none."""
    rows_source: Literal["argument", "measured", "none"]
    """Whether ``n`` came from the caller's ``max_num_seqs`` or from the row
    rule (see the module docstring)."""
    caches: list[CacheEntry]

    @property
    def declaration_names(self) -> list[str]:
        """Names, for a log line that points at the declarer."""
        return [d.name for d in self.declarations]


class AuditReport(BaseModel):
    """Everything one audit found, ready for ``model_dump_json`` and a table."""

    owners: list[OwnerAudit]
    failures: list[FailureEntry]
    max_num_seqs: int | None
    """The caller's live-sequence count, or None when derived per owner."""

    @computed_field  # type: ignore[prop-decorator]
    @property
    def failed(self) -> bool:
        """True when some owner holds more than it declared (or declared
        nothing): the cases that make the planner admit too many sequences.
        Over-declared and absent owners waste capacity but cannot crash."""
        return any(o.verdict in ("under-declared", "undeclared") for o in self.owners)

    @property
    def total_declared_bytes(self) -> int:
        return sum(o.declared_bytes for o in self.owners)

    @property
    def total_measured_bytes(self) -> int:
        return sum(o.measured_bytes for o in self.owners)

    def render_table(self) -> str:
        """One line per owner, then its declarations and caches, every figure
        in exact bytes and MiB so a reader can redo the arithmetic."""
        lines: list[str] = []
        header = f"{'owner':<32} {'verdict':<20} {'declared':>30} {'measured':>30}  seqs"
        lines.append(header)
        lines.append("-" * len(header))
        for o in self.owners:
            seqs = "-" if o.live_sequences is None else str(o.live_sequences)
            lines.append(
                f"{o.owner or '<root>':<32} {o.verdict:<20} {format_bytes(o.declared_bytes):>30} "
                f"{format_bytes(o.measured_bytes):>30}  {seqs}"
            )
            difference = o.measured_bytes - o.declared_bytes
            if difference > 0 and o.declarations:
                lines.append(f"    measured exceeds declared by {format_bytes(difference)}")
            for d in o.declarations:
                lines.append(
                    f"    declares {d.name} ({d.scope}, {d.rows_driver}): "
                    f"{format_bytes(d.bytes_per_row)} per row x {d.rows} rows = {format_bytes(d.bytes)}"
                )
            for c in o.caches:
                rows = "?" if c.rows is None else str(c.rows)
                via = "" if c.held_by == o.owner else f" (held by {c.held_by or '<root>'})"
                lines.append(
                    f"    holds {c.path}{via} ({c.cache_class}, {rows} rows, {len(c.layers)} layers): "
                    f"{format_bytes(c.bytes)}"
                )
        for f in self.failures:
            lines.append(f"declarer failed: {f.owner or '<root>'}: {f.error}")
        lines.append(
            f"total declared {format_bytes(self.total_declared_bytes)}, "
            f"measured {format_bytes(self.total_measured_bytes)}: "
            + ("FAILED" if self.failed else "ok")
        )
        return "\n".join(lines)


# --------------------------------------------------------------------------
# Measuring


def _tensors_in(value: Any, depth: int = 3) -> list[torch.Tensor]:
    """Tensors directly in ``value`` or inside tuples, lists and dicts
    (a quantized state is often ``(packed, {"scale": ..., "zero": ...})``)."""
    if isinstance(value, torch.Tensor):
        return [value]
    found: list[torch.Tensor] = []
    if depth <= 0:
        return found
    if isinstance(value, (list, tuple)):
        for item in value:
            found.extend(_tensors_in(item, depth - 1))
    elif isinstance(value, dict):
        for item in value.values():
            found.extend(_tensors_in(item, depth - 1))
    return found


def _plain_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that own memory. A wrapper subclass (e.g. an
    optimum-quanto ``QTensor``) has a storage of its own that is not where its
    data lives; its inner tensors are."""
    if hasattr(type(tensor), "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        inner: list[torch.Tensor] = []
        for name in names:
            inner.extend(_plain_tensors(getattr(tensor, name)))
        return inner
    return [tensor]


def _storage_bytes(tensor: torch.Tensor, seen: set[tuple[str, int | None, int]]) -> tuple[int, int]:
    """(new storage bytes, view bytes) of one tensor, adding its storages to
    ``seen``. Meta tensors report a storage size but own no memory: 0."""
    new = 0
    view = 0
    for plain in _plain_tensors(tensor):
        if plain.device.type == "meta":
            continue
        if plain.layout != torch.strided:
            raise UnsupportedCacheError(
                f"a cache tensor has layout {plain.layout}; only strided tensors have a "
                "storage whose bytes can be counted"
            )
        view += plain.numel() * plain.element_size()
        storage = plain.untyped_storage()
        size = storage.nbytes()
        if size == 0:
            continue
        key = (storage.device.type, storage.device.index, storage.data_ptr())
        if key in seen:
            continue
        seen.add(key)
        new += size
    return new, view


def _check_layer(layer: Any) -> None:
    """Refuse layers whose memory we would count wrongly."""
    if isinstance(layer, LinearAttentionCacheLayerMixin):
        raise UnsupportedCacheError(
            f"cache layer {type(layer).__name__} holds linear-attention (conv/recurrent) state, "
            "not attention KV positions; a kv-budget declaration cannot describe it"
        )
    if not isinstance(layer, CacheLayerMixin):
        raise UnsupportedCacheError(
            f"cache layer {type(layer).__name__} is not a transformers CacheLayerMixin; "
            "its memory layout is unknown"
        )
    for attr, value in vars(layer).items():
        if attr in _KV_ATTRIBUTES or attr in _BOOKKEEPING_ATTRIBUTES:
            continue
        if _tensors_in(value):
            raise UnsupportedCacheError(
                f"cache layer {type(layer).__name__} holds tensors in attribute {attr!r}, "
                "which is neither known KV nor known bookkeeping; refusing to guess whether "
                "it counts"
            )


def _layer_batch(layer: Any) -> int | None:
    keys = getattr(layer, "keys", None)
    if isinstance(keys, torch.Tensor) and keys.dim() == 4:
        return int(keys.shape[0])
    packed = getattr(layer, "_quantized_keys", None)
    if isinstance(packed, torch.Tensor) and packed.dim() == 4:
        return int(packed.shape[0])
    return None


def _layer_positions(layer: Any) -> int:
    if isinstance(layer, QuantizedLayer):
        # A quantized layer never drops a token: each one seen is either in
        # the packed states or in the full-precision residual.
        return int(layer.cumulative_length)
    keys = getattr(layer, "keys", None)
    if isinstance(keys, torch.Tensor) and keys.dim() == 4:
        return int(keys.shape[-2])
    return 0


def _layer_device(layer: Any) -> str | None:
    for attr in _KV_ATTRIBUTES:
        tensors = _tensors_in(getattr(layer, attr, None))
        if tensors:
            return str(tensors[0].device)
    return None


def _parts(cache: Any) -> list[tuple[str, Any]]:
    """(kind, layer) for every layer of a cache, self-attention first."""
    if not isinstance(cache, Cache):
        raise UnsupportedCacheError(
            f"{type(cache).__name__} is not a transformers Cache; nothing to measure"
        )
    if isinstance(cache, EncoderDecoderCache):
        return [("self", layer) for _, layer in _parts(cache.self_attention_cache)] + [
            ("cross", layer) for _, layer in _parts(cache.cross_attention_cache)
        ]
    for attr, value in vars(cache).items():
        if attr != "layers" and _tensors_in(value):
            raise UnsupportedCacheError(
                f"{type(cache).__name__} holds tensors in attribute {attr!r} outside its layers; "
                "refusing to guess whether they count"
            )
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list):
        raise UnsupportedCacheError(
            f"{type(cache).__name__} has no list of layers; its memory layout is unknown"
        )
    return [("self", layer) for layer in layers]


def _breakdown(cache: Any, seen: set[tuple[str, int | None, int]]) -> list[LayerBytes]:
    result: list[LayerBytes] = []
    index = {"self": 0, "cross": 0}
    for kind, layer in _parts(cache):
        _check_layer(layer)
        new = 0
        view = 0
        for attr in _KV_ATTRIBUTES:
            for tensor in _tensors_in(getattr(layer, attr, None)):
                tensor_new, tensor_view = _storage_bytes(tensor, seen)
                new += tensor_new
                view += tensor_view
        result.append(
            LayerBytes(
                index=index[kind],
                kind=kind,
                layer_class=type(layer).__name__,
                batch=_layer_batch(layer),
                positions=_layer_positions(layer),
                view_bytes=view,
                bytes=new,
                device=_layer_device(layer),
            )
        )
        index[kind] += 1
    return result


def cache_breakdown(cache: Cache) -> list[LayerBytes]:
    """Per-layer bytes of a live transformers cache, each storage counted
    once (a later layer sharing an earlier one's storage shows 0 bytes).

    Raises :class:`UnsupportedCacheError` for anything it cannot count fully.
    """
    return _breakdown(cache, set())


def measure_cache_bytes(cache: Cache) -> int:
    """Bytes a live transformers 5.x cache holds: the storages behind its
    key/value tensors, each once. Why storages and not views: see the module
    docstring (a sliding layer's W - 1 view keeps W positions alive)."""
    return sum(layer.bytes for layer in cache_breakdown(cache))


def _cache_rows(layers: list[LayerBytes]) -> int | None:
    batches = {layer.batch for layer in layers if layer.batch is not None}
    if len(batches) > 1:
        raise AuditError(f"cache layers disagree on the batch dimension: {sorted(batches)}")
    if batches:
        return batches.pop()
    if sum(layer.bytes for layer in layers) == 0:
        return 0
    return None


# --------------------------------------------------------------------------
# Finding caches


def _caches_in(label: str, value: Any, depth: int) -> list[tuple[str, Cache]]:
    if isinstance(value, Cache):
        return [(label, value)]
    found: list[tuple[str, Cache]] = []
    if depth <= 0:
        return found
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found.extend(_caches_in(f"{label}[{i}]", item, depth - 1))
    elif isinstance(value, dict):
        for key, item in value.items():
            found.extend(_caches_in(f"{label}[{key!r}]", item, depth - 1))
    elif _is_plain_object(value):
        for attr, item in vars(value).items():
            found.extend(_caches_in(f"{label}.{attr}", item, depth - 1))
    return found


def _is_plain_object(value: Any) -> bool:
    """An instance whose attributes may hold state (a runtime helper, a
    session dataclass); not a module (an owner of its own), tensor, class,
    function or Python module."""
    if isinstance(
        value,
        (torch.nn.Module, torch.Tensor, type, types.ModuleType, types.FunctionType, types.MethodType),
    ):
        return False
    return isinstance(getattr(value, "__dict__", None), dict)


def _held_caches(owner: Any) -> list[tuple[str, str, Cache]]:
    """(attribute, path, cache) for every cache an owner keeps, each cache
    object once."""
    try:
        attributes = vars(owner)
    except TypeError as exc:
        raise TypeError(
            f"{type(owner).__name__} has no instance attributes to search for caches"
        ) from exc
    found: list[tuple[str, str, Cache]] = []
    ids: set[int] = set()
    for attr, value in attributes.items():
        if attr in _SKIPPED_MODULE_ATTRIBUTES and isinstance(owner, torch.nn.Module):
            continue
        for path, cache in _caches_in(attr, value, _CONTAINER_DEPTH):
            if id(cache) not in ids:
                ids.add(id(cache))
                found.append((attr, path, cache))
    return found


def _is_below(path: str, ancestor: str) -> bool:
    """Whether module ``path`` is a strict descendant of ``ancestor`` ("" is the root)."""
    if path == ancestor:
        return False
    return ancestor == "" or path.startswith(ancestor + ".")


def _verdict(has_specs: bool, has_caches: bool, declared: int, measured: int) -> Verdict:
    if not has_caches:
        return "declared-but-absent"
    if not has_specs:
        return "undeclared"
    if measured > declared:
        return "under-declared"
    if measured < declared:
        return "over-declared"
    return "match"


def _live_sequences(owner: str, caches: list[CacheEntry]) -> int:
    """The row rule of the module docstring: the smallest row count among
    the attributes that hold rows."""
    per_attribute: dict[str, int] = {}
    for cache in caches:
        if cache.rows is None:
            raise AuditError(
                f"owner {owner or '<root>'!r}: cannot read the batch dimension of {cache.path} "
                f"({cache.cache_class}); pass max_num_seqs to audit_module"
            )
        per_attribute[cache.attribute] = per_attribute.get(cache.attribute, 0) + cache.rows
    counts = [rows for rows in per_attribute.values() if rows > 0]
    return min(counts) if counts else 0


def _attribute(
    paths: list[str], held: dict[str, list[tuple[str, str, Cache]]], declaring: Any,
) -> tuple[dict[int, list[str]], dict[int, str]]:
    """The attribution rule of the module docstring: ``holders`` (cache id
    -> holder paths in walk order) and ``assigned`` (cache id -> owner)."""
    holders: dict[int, list[str]] = {}
    for path in paths:
        for _, _, cache in held[path]:
            holders.setdefault(id(cache), []).append(path)
    assigned: dict[int, str] = {}
    for cache_id, cache_holders in holders.items():
        owners = [p for p in cache_holders if p in declaring]
        if not owners:
            owners = [p for p in declaring if _is_below(p, cache_holders[0])]
        assigned[cache_id] = owners[0] if len(owners) == 1 else cache_holders[0]
    return holders, assigned


class HeldBytes:
    """The bytes each declaring owner's caches hold now, for sampling while
    a model serves (:mod:`kv_budget.watch.live`).

    The same finding, attribution and storage counting as
    :func:`audit_module`, but over the declaring owners and their ancestors
    only (an ancestor may hold a cache its declaring child is charged
    with), found once when built: a sample then reads a handful of
    modules' attributes, not the whole model's.
    """

    def __init__(self, module: Any, declaring_owners: list[str]) -> None:
        root = unwrap_model(module)
        self.owners = list(dict.fromkeys(declaring_owners))
        wanted = set(self.owners)
        self.holders = [
            (path, obj) for path, obj in walk_modules(root)
            if path in wanted or any(_is_below(owner, path) for owner in wanted)
        ]
        self._layer_others: dict[tuple[type, frozenset[str]], tuple[str, ...]] = {}

    def measure(self) -> dict[str, int]:
        """Bytes per declaring owner (0 when it holds none), each storage once."""
        held = {path: _held_caches(obj) for path, obj in self.holders}
        paths = [path for path, _ in self.holders]
        _, assigned = _attribute(paths, held, set(self.owners))
        result = {owner: 0 for owner in self.owners}
        seen: set[tuple[str, int | None, int]] = set()
        counted: set[int] = set()
        for path in paths:
            for _, _, cache in held[path]:
                owner = assigned[id(cache)]
                if owner in result and id(cache) not in counted:
                    counted.add(id(cache))
                    result[owner] += self._cache_bytes(cache, seen)
        return result

    def _cache_bytes(self, cache: Cache, seen: set[tuple[str, int | None, int]]) -> int:
        """:func:`measure_cache_bytes` without the per-layer report: the
        same refusals and the same storages, at a fraction of the cost
        (a sample of 256 requests' caches took 38 ms through
        :func:`_breakdown`, most of it building the report). A layer's
        attributes are checked in full once per layer class and attribute
        set; after that only its attributes outside the known KV and
        bookkeeping ones are looked at again."""
        total = 0
        for _, layer in _parts(cache):
            attributes = vars(layer)
            signature = (type(layer), frozenset(attributes))
            others = self._layer_others.get(signature)
            if others is None:
                _check_layer(layer)
                others = self._layer_others[signature] = tuple(
                    a for a in attributes if a not in _KV_ATTRIBUTES and a not in _BOOKKEEPING_ATTRIBUTES)
            else:
                for a in others:
                    value = attributes[a]
                    if isinstance(value, (torch.Tensor, list, tuple, dict)) and _tensors_in(value):
                        _check_layer(layer)  # raises, naming the attribute
            for attr in _KV_ATTRIBUTES:
                value = attributes.get(attr)
                if value is None:
                    continue
                if type(value) is torch.Tensor and value.layout == torch.strided and value.device.type != "meta":
                    storage = value.untyped_storage()
                    key = (value.device.type, value.device.index, storage.data_ptr())
                    if key not in seen:
                        seen.add(key)
                        total += storage.nbytes()
                    continue
                for tensor in _tensors_in(value):
                    total += _storage_bytes(tensor, seen)[0]
        return total


def audit_module(module: Any, max_num_seqs: int | None = None) -> AuditReport:
    """Compare every owner's declarations with the caches it holds now.

    ``module`` is a loaded (and already run) model, or any object with
    attributes; it is unwrapped as the collector does. ``max_num_seqs``, when
    given, is the number of live sequences charged to ``max_num_seqs``
    declarations; otherwise it is derived per owner by the row rule in the
    module docstring.
    """
    if max_num_seqs is not None and (
        isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1
    ):
        raise ValueError(f"max_num_seqs = {max_num_seqs!r}: expected an int >= 1 or None")
    root = unwrap_model(module)
    if isinstance(root, Cache):
        raise TypeError("audit_module() takes a model, not a cache; use measure_cache_bytes()")
    if not isinstance(root, torch.nn.Module) and not hasattr(root, "__dict__"):
        raise TypeError(f"{type(root).__name__} has no instance attributes to search for caches")

    collection = collect_model_local_kv_specs(root)
    specs_by_owner: dict[str, list[ModelLocalKVSpec]] = {}
    for owned in collection.specs:
        specs_by_owner.setdefault(owned.owner, []).append(owned.spec)

    owners = walk_modules(root)
    held = {path: _held_caches(obj) for path, obj in owners}
    holders, assigned = _attribute([path for path, _ in owners], held, specs_by_owner)
    # Each cache once, seen from the owner itself when it holds the cache,
    # else from its first holder.
    caches_of: dict[str, list[tuple[str, str, str, Cache]]] = {}
    for holder, _ in owners:
        for attr, label, cache in held[holder]:
            owner = assigned[id(cache)]
            seen_from = owner if owner in holders[id(cache)] else holders[id(cache)][0]
            if holder == seen_from:
                caches_of.setdefault(owner, []).append((holder, attr, label, cache))

    seen: set[tuple[str, int | None, int]] = set()
    entries: list[OwnerAudit] = []
    for path, _ in owners:
        caches: list[CacheEntry] = []
        for holder, attr, label, cache in caches_of.get(path, []):
            layers = _breakdown(cache, seen)
            caches.append(
                CacheEntry(
                    attribute=attr,
                    held_by=holder,
                    path=label,
                    cache_class=type(cache).__name__,
                    rows=_cache_rows(layers),
                    bytes=sum(layer.bytes for layer in layers),
                    layers=layers,
                )
            )
        specs = specs_by_owner.get(path, [])
        if not specs and not caches:
            continue
        per_sequence = any(spec.rows is RowDriver.MAX_NUM_SEQS for spec in specs)
        live: int | None = None
        source: Literal["argument", "measured", "none"] = "none"
        if per_sequence:
            if max_num_seqs is not None:
                live, source = max_num_seqs, "argument"
            else:
                live, source = _live_sequences(path, caches), "measured"
        declarations: list[DeclarationEntry] = []
        for spec in specs:
            rows = spec.rows_fixed if spec.rows is RowDriver.FIXED else live
            assert rows is not None
            declarations.append(
                DeclarationEntry(
                    name=spec.name,
                    scope=spec.scope.value,
                    rows_driver=spec.rows.value,
                    bytes_per_row=spec.bytes_per_row,
                    rows=rows,
                    bytes=spec.bytes_per_row * rows,
                )
            )
        declared = sum(d.bytes for d in declarations)
        measured = sum(c.bytes for c in caches)
        entries.append(
            OwnerAudit(
                owner=path,
                verdict=_verdict(bool(specs), bool(caches), declared, measured),
                declarations=declarations,
                declared_bytes=declared,
                measured_bytes=measured,
                live_sequences=live,
                rows_source=source,
                caches=caches,
            )
        )
    failures = [FailureEntry(owner=f.owner, error=f.error) for f in collection.failures]
    return AuditReport(owners=entries, failures=failures, max_num_seqs=max_num_seqs)


# --------------------------------------------------------------------------
# Loading a factory


def _one_line(text: str) -> str:
    return " ".join(text.split())


def load_factory(target: str) -> Any:
    """Import ``"package.module:function"``, call the function with no
    arguments and return what it built (the model to audit).

    A bad target raises ``ValueError`` with a one-line message (a CLI prints
    it as is). An exception raised *by the factory* propagates unchanged:
    its traceback is what the author needs. A factory that returns None is
    refused: auditing None finds nothing and would read as a pass.
    """
    if not isinstance(target, str) or target.count(":") != 1:
        raise ValueError(f"factory {target!r}: expected 'package.module:function' with one ':'")
    module_name, _, attr_path = target.partition(":")
    if not module_name.strip() or not attr_path.strip():
        raise ValueError(f"factory {target!r}: module and function must both be non-empty")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is a bad target
        raise ValueError(
            _one_line(f"factory {target!r}: cannot import {module_name!r}: {type(exc).__name__}: {exc}")
        ) from exc
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"factory {target!r}: {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(
            f"factory {target!r}: {attr_path!r} is a {type(obj).__name__}, not callable"
        )
    built = obj()
    if built is None:
        raise ValueError(f"factory {target!r} returned None, expected the model to audit")
    return built
