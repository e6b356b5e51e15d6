"""Count the bytes a model's ``transformers`` caches really hold, and find
which owner holds each.

A declaration (:mod:`kv_budget.declare.spec`) is a promise written by hand;
the planner believes it. This module measures what it promises, for the
offline audit (:mod:`kv_budget.audit`) and for sampling while serving
(:mod:`kv_budget.watch.live`). One entry point per job:
:func:`cache_breakdown` (one cache, per layer), :func:`measure_cache_bytes`
(one cache, in total), :func:`held_caches` (the caches one owner keeps),
:func:`attribute_caches` (the owner each cache is charged to) and
:class:`HeldBytes` (the declaring owners' bytes now, cheaply, again and
again).

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
    rather than half counted: a partial count reads as a smaller cache than
    the truth, which is the dangerous direction.

Where caches are found
    Each module of ``named_modules()`` (after the same ``unwrap()`` the
    collector does; a non-Module root is one owner, "") is an owner. Its
    instance attributes (``vars(module)`` minus ``_modules``, ``_parameters``
    and ``_buffers``) are searched for ``Cache`` objects, directly or inside
    lists, tuples, dicts and the attributes of plain objects, up to three
    levels (a dict of sessions, a dict of lists, a runtime helper's dict of
    session-state dataclasses: where vLLM-Omni's MiniCPM-o keeps each duplex
    session's encoder cache). Modules met on the way are not entered: they
    are owners of their own.

Who a cache is charged to
    A cache held by several owners is attributed once: to the single holder
    that declares something if exactly one does, else to the first holder in
    walk order. A cache whose holders all declare nothing goes to the single
    declaring module below its first holder, when there is exactly one:
    vLLM-Omni's Qwen3-TTS stage model keeps each request's decoder state
    (caches included) in a dict of its own while its ``decoder`` child
    declares them, and by holder alone that one cache would read twice, the
    stage model "undeclared" and the decoder "declared-but-absent". With no
    declaring module below, or several, the cache stays with its holder. A
    storage is counted once per report (the callers share one ``seen`` set),
    for the first owner that reaches it.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from pydantic import BaseModel
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    EncoderDecoderCache,
    LinearAttentionCacheLayerMixin,
    QuantizedLayer,
)

from kv_budget.collect.model import unwrap_model, walk_modules
from kv_budget.errors import KvBudgetError

__all__ = [
    "UnsupportedCacheError",
    "LayerBytes",
    "cache_breakdown",
    "measure_cache_bytes",
    "cache_layer_storages",
    "caches_in",
    "held_caches",
    "attribute_caches",
    "HeldBytes",
]

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
cache. Two levels would miss that last layout entirely: four sessions'
caches held while the audit reported the declaration absent and passed.
Deeper structures are rare, and searching arbitrary object graphs would find
caches that belong to someone else."""


class UnsupportedCacheError(KvBudgetError, TypeError):
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


def cache_breakdown(cache: Cache, *, seen: set[tuple[str, int | None, int]] | None = None) -> list[LayerBytes]:
    """Per-layer bytes of a live transformers cache, each storage counted
    once (a later layer sharing an earlier one's storage shows 0 bytes).

    ``seen`` holds the storages an earlier cache of the same report already
    counted (device type, device index, data pointer); it is updated in
    place, so a report that passes one set counts each storage once in all.

    Raises :class:`UnsupportedCacheError` for anything it cannot count fully.
    """
    if seen is None:
        seen = set()
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


def cache_layer_storages(layer: Any) -> list[tuple[tuple[str, int | None, int], int]]:
    """(storage, bytes) for each storage behind one layer's key/value
    tensors, each once: what :mod:`kv_budget.sample.in_step` recounts when
    the layer is updated. Same refusals as :func:`cache_breakdown`."""
    _check_layer(layer)
    seen: set[tuple[str, int | None, int]] = set()
    storages = []
    for attr in _KV_ATTRIBUTES:
        for tensor in _tensors_in(getattr(layer, attr, None)):
            for plain in _plain_tensors(tensor):
                before = len(seen)
                size = _storage_bytes(plain, seen)[0]
                if len(seen) > before:
                    storage = plain.untyped_storage()
                    storages.append(((storage.device.type, storage.device.index, storage.data_ptr()), size))
    return storages


def measure_cache_bytes(cache: Cache) -> int:
    """Bytes a live transformers 5.x cache holds: the storages behind its
    key/value tensors, each once. Why storages and not views: see the module
    docstring (a sliding layer's W - 1 view keeps W positions alive)."""
    return sum(layer.bytes for layer in cache_breakdown(cache))


# --------------------------------------------------------------------------
# Finding caches


def caches_in(label: str, value: Any, depth: int = _CONTAINER_DEPTH) -> list[tuple[str, Cache]]:
    """(path, cache) for every cache in ``value`` or in the lists, tuples,
    dicts and plain objects inside it, up to ``depth`` levels."""
    if isinstance(value, Cache):
        return [(label, value)]
    found: list[tuple[str, Cache]] = []
    if depth <= 0:
        return found
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found.extend(caches_in(f"{label}[{i}]", item, depth - 1))
    elif isinstance(value, dict):
        for key, item in value.items():
            found.extend(caches_in(f"{label}[{key!r}]", item, depth - 1))
    elif _is_plain_object(value):
        for attr, item in vars(value).items():
            found.extend(caches_in(f"{label}.{attr}", item, depth - 1))
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


def held_caches(owner: Any) -> list[tuple[str, str, Cache]]:
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
        for path, cache in caches_in(attr, value, _CONTAINER_DEPTH):
            if id(cache) not in ids:
                ids.add(id(cache))
                found.append((attr, path, cache))
    return found


def _is_below(path: str, ancestor: str) -> bool:
    """Whether module ``path`` is a strict descendant of ``ancestor`` ("" is the root)."""
    if path == ancestor:
        return False
    return ancestor == "" or path.startswith(ancestor + ".")


def attribute_caches(
    paths: list[str], held: dict[str, list[tuple[str, str, Cache]]], declaring: Any,
) -> tuple[dict[int, list[str]], dict[int, str]]:
    """The attribution rule of the module docstring, over the owners at
    ``paths`` (walk order), the caches each holds (``held``, from
    :func:`held_caches`) and the owners that declare (``declaring``, any
    container of paths): ``holders`` (cache id -> holder paths in walk
    order) and ``assigned`` (cache id -> owner)."""
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
    a model serves (:mod:`kv_budget.watch.live`), and those of the modules
    that declare nothing but were seen holding caches (``undeclared_holders``).

    The same finding, attribution and storage counting as the audit
    (:func:`kv_budget.audit.audit_module`), but over the declaring owners,
    the undeclared holders and their ancestors only (an ancestor may hold a
    cache its declaring child is charged with), found once when built: a
    sample then reads a handful of modules' attributes, not the whole
    model's. Attribution only ever charges a declaring owner; a cache no
    declaring owner is charged with is counted under its first holder when
    that holder is one of ``undeclared_holders``: a model that declares
    nothing (vLLM-Omni's Qwen3-TTS off CUDA) keeps its per-request caches
    between steps too, and a watch that saw them only inside a step would
    read their retained bytes as 0.
    """

    def __init__(self, module: Any, declaring_owners: list[str], undeclared_holders: list[str] = ()) -> None:
        root = unwrap_model(module)
        self.owners = list(dict.fromkeys(declaring_owners))
        self.undeclared_holders = [h for h in dict.fromkeys(undeclared_holders) if h not in self.owners]
        wanted = set(self.owners) | set(self.undeclared_holders)
        self.holders = [
            (path, obj) for path, obj in walk_modules(root)
            if path in wanted or any(_is_below(owner, path) for owner in wanted)
        ]
        self._layer_others: dict[tuple[type, frozenset[str]], tuple[str, ...]] = {}

    def measure(self) -> dict[str, int]:
        """Bytes per declaring owner and undeclared holder (0 when it holds
        none), each storage once."""
        return self.measure_apart(set())[0]

    def measure_apart(self, apart: set[int]) -> tuple[dict[str, int], dict[str, int]]:
        """:meth:`measure`, and the same figures without the caches whose
        ids are in ``apart`` (those an in-step window already counted,
        :mod:`kv_budget.sample.in_step`), from one walk."""
        held = {path: held_caches(obj) for path, obj in self.holders}
        paths = [path for path, _ in self.holders]
        _, assigned = attribute_caches(paths, held, set(self.owners))
        result = {owner: 0 for owner in [*self.owners, *self.undeclared_holders]}
        rest = dict(result)
        seen: set[tuple[str, int | None, int]] = set()
        counted: set[int] = set()
        for path in paths:
            for _, _, cache in held[path]:
                owner = assigned[id(cache)]
                if owner in result and id(cache) not in counted:
                    counted.add(id(cache))
                    size = self._cache_bytes(cache, seen)
                    result[owner] += size
                    if id(cache) not in apart:
                        rest[owner] += size
        return result, rest

    def _cache_bytes(self, cache: Cache, seen: set[tuple[str, int | None, int]]) -> int:
        """:func:`measure_cache_bytes` without the per-layer report: the
        same refusals and the same storages, at a fraction of the cost
        (a sample of 256 requests' caches took 38 ms through
        :func:`cache_breakdown`, most of it building the report). A layer's
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
