"""The most bytes a model's ``transformers`` caches held at once inside one
engine step, per owner: what a sample between steps cannot see.

A cache of scope ``invocation`` (a per-step working copy, the rows of one
step) is built and freed inside the model's forward, so
:class:`kv_budget.sample.caches.HeldBytes`, which reads the model's
attributes after the step, never meets it. :class:`InStepTracker` is told of
every ``Cache.update`` made while it is tracking (the engine glue wraps that
one method, the funnel every ``transformers`` cache grows through, and
forwards each call to :meth:`InStepTracker.cache_updated`) and keeps, for
each cache it has met, the storages behind its key/value tensors: the
audit's counting (:mod:`kv_budget.sample.caches`), each storage once. A
cache that is garbage collected leaves the count at once (a weak-reference
finalizer), so the running total is what is held at that moment, and its
maximum over the window is the peak.

Which caches are met
    A cache is met at its first update in a window. Meeting one walks the
    Python frames on the stack once, outwards from the update; every cache
    the model's module frames reach (a frame whose ``self`` is a module of
    this model: its local variables and that module's attributes, searched
    as :func:`kv_budget.sample.caches.held_caches` searches) is met then
    too. So a cache that never goes through ``Cache.update`` (a batched
    copy built by concatenation, a request's cache replaced by slicing) is
    counted from the moment a frame next to an updated one holds it.

Who a cache is charged to
    Its holders are the module frames that reach it. The owner is the one
    holder that declares. With none, it is the innermost declaring module
    on the stack: a cache a child transformer builds and returns is the
    declaring decoder's, whose forward it was built under. With no
    declaring module on the stack, or several declaring holders, it is the
    outermost holder. When no frame holds it (a cache reached only through
    arguments), its holder is the innermost module frame. A cache updated
    outside every frame of this model is not counted.

    The audit's rule (:func:`kv_budget.sample.caches.attribute_caches`) also
    gives a cache whose holders all declare nothing to the one declaring
    module below them, because between steps only attributes say where a
    cache belongs. Inside a step the stack says it: a cache the root builds
    and passes to an undeclared sibling of the declaring module is not
    that module's.

Declared and undeclared
    An owner that declares is reported under its path; a holder that does
    not declare is reported as ``undeclared``: caches the model builds
    under its forward that no declaration covers.

What it cannot see
    A cache that grows without ``Cache.update`` (a layer's tensors assigned
    directly), or whose update runs in compiled code (torch.compile, CUDA
    graphs replay no Python), is not met; a cache met once and then changed
    only by other methods (``crop``, ``reorder_cache``) keeps the bytes of
    its last update. Caches kept across steps are still measured after the
    step by :class:`~kv_budget.sample.caches.HeldBytes`, and the caller adds
    the ones not updated in the window (:meth:`InStepPeaks.with_untouched`).
"""

from __future__ import annotations

import inspect
import sys
import time
import weakref
from typing import Any

from pydantic import BaseModel
from transformers.cache_utils import Cache, EncoderDecoderCache

from kv_budget.collect.model import unwrap_model, walk_modules
from kv_budget.sample.caches import UnsupportedCacheError, cache_layer_storages, caches_in, held_caches

__all__ = ["InStepPeaks", "InStepTracker"]

_FRAME_DEPTH = 96
"""How many frames above ``Cache.update`` are searched for the model's
modules: a vLLM worker's step is about 40 frames deep from the worker loop,
a model's own nesting rarely 20."""

_StorageKey = tuple[str, int | None, int]

_SNAPSHOT_LOCALS = sys.version_info < (3, 13)
"""Whether ``frame.f_locals`` of a function frame is a snapshot dict kept
on the frame (CPython before 3.13; from 3.13 it is a view that holds
nothing, PEP 667)."""


def _release_locals_snapshot(frame: Any, local: Any) -> None:
    """Empty the locals snapshot that reading ``frame.f_locals`` left on a
    running function frame. Why: the snapshot keeps every value the frame
    held at that moment until the frame returns, even after the function
    rebinds or drops it, so watching a step would make the step hold more
    (a model filling a cache layer by layer kept its first layer's
    temporaries to the end: 1 MiB per sequence of the demo talker, about
    10 % of the worker's growth under load, ``benchmarks/bench_watch_memory.py``).
    The frame's variables are untouched: the next ``locals()`` or
    ``f_locals`` fills the snapshot afresh, as a debugger's next event does.
    A module or class body frame (not optimized) is left alone: its
    ``f_locals`` is its namespace itself. What is lost: a function that
    keeps the dict ``locals()`` returned and reads it after a watched cache
    update in a callee sees it empty (CPython before 3.13 only)."""
    if _SNAPSHOT_LOCALS and frame.f_code.co_flags & inspect.CO_OPTIMIZED and isinstance(local, dict):
        local.clear()


class InStepPeaks(BaseModel):
    """What one tracking window saw."""

    owners: dict[str, int]
    """Peak bytes per declaring owner (0 when it held nothing in the window)."""
    undeclared: dict[str, int]
    """Peak bytes per holding module that declares nothing."""
    peak_bytes: int
    """The most every tracked cache held at once (declared and undeclared)."""
    caches: int
    """Caches met in the window."""
    updates: int
    """``Cache.update`` calls counted."""
    seconds: float
    """CPU time spent in :meth:`InStepTracker.cache_updated`: what tracking added to the step."""
    error: str | None = None
    """Why tracking stopped (a cache it cannot count); the figures are then not used."""

    def with_untouched(self, untouched: dict[str, int]) -> InStepPeaks:
        """Add the caches that lived through the window without an update
        (measured after it, per declaring owner or undeclared holder): they
        were held all along."""
        owners = {owner: held + untouched.get(owner, 0) for owner, held in self.owners.items()}
        undeclared = dict(self.undeclared)
        for holder, size in untouched.items():
            if holder not in owners and size:
                undeclared[holder] = undeclared.get(holder, 0) + size
        return self.model_copy(update={"owners": owners, "undeclared": undeclared,
                                       "peak_bytes": self.peak_bytes + sum(untouched.values())})


class _Tracked:
    """One cache met in the window: its owner and each layer's storages."""

    __slots__ = ("owner", "layers")

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.layers: dict[int, list[_StorageKey]] = {}


class InStepTracker:
    """Counts the caches updated under one model's forward, between
    :meth:`begin` and :meth:`end`; built once per model (the module paths
    are walked once)."""

    def __init__(self, module: Any, declaring_owners: list[str]) -> None:
        root = unwrap_model(module)
        self.owners = list(dict.fromkeys(declaring_owners))
        self._declaring = set(self.owners)
        self._paths = {id(obj): path for path, obj in walk_modules(root)}
        self._tracking = False
        self._watched: weakref.WeakSet = weakref.WeakSet()
        """Caches that carry this tracker's finalizer: one each, whatever
        the number of windows they live through."""
        self._reset()

    def _reset(self) -> None:
        self._caches: dict[int, _Tracked] = {}
        self._ignored: set[int] = set()
        self._storages: dict[_StorageKey, list] = {}
        """Storage -> [bytes, references from tracked layers, owner it is charged to]."""
        self._held: dict[str, int] = {}
        self._peak: dict[str, int] = {}
        self._total = 0
        self._peak_total = 0
        self._attributes: dict[int, list[Cache]] = {}
        """Per module met on the stack in this window: the caches its attributes reach, searched once."""
        self._met = 0
        self._updates = 0
        self._seconds = 0.0
        self._error: str | None = None

    @property
    def tracking(self) -> bool:
        return self._tracking

    def begin(self) -> None:
        """Start a window: nothing counted yet."""
        self._reset()
        self._tracking = True

    def end(self) -> InStepPeaks:
        """Close the window and return its peaks. The caches the window's
        module attributes reached are let go here: held until the next
        window, a finished request's cache would outlive its request."""
        self._tracking = False
        self._attributes = {}
        return InStepPeaks(
            owners={owner: self._peak.get(owner, 0) for owner in self.owners},
            undeclared={owner: peak for owner, peak in self._peak.items() if owner not in self._declaring},
            peak_bytes=self._peak_total,
            caches=self._met,
            updates=self._updates,
            seconds=self._seconds,
            error=self._error,
        )

    def held_now(self) -> dict[str, int]:
        """What the caches met so far hold at this moment, per owner
        (declaring or undeclared): the running count the peaks are taken
        from, for a caller that checks it against a count of its own."""
        return {owner: held for owner, held in self._held.items() if held}

    def touched(self) -> set[int]:
        """Ids of the caches met in the window that are still alive."""
        return set(self._caches)

    def cache_updated(self, cache: Cache, layer_idx: int) -> None:
        """One ``Cache.update(..., layer_idx)`` has returned: recount that
        layer (every layer at the cache's first update) and move the peaks."""
        if not self._tracking or self._error is not None:
            return
        began = time.thread_time()
        try:
            self._count(cache, layer_idx)
        except UnsupportedCacheError as exc:
            self._error = str(exc)
        self._updates += 1
        self._seconds += time.thread_time() - began

    def _count(self, cache: Cache, layer_idx: int) -> None:
        key = id(cache)
        if key in self._ignored:
            return
        tracked = self._caches.get(key)
        if tracked is None:
            self._meet_from_stack(cache)
        else:
            self._recount(tracked, cache, (layer_idx,))
        tracked = self._caches.get(key)
        if tracked is None:
            return
        if self._total > self._peak_total:
            self._peak_total = self._total
        for owner, held in self._held.items():
            if held > self._peak.get(owner, -1):
                self._peak[owner] = held

    def _meet_from_stack(self, updated: Cache) -> None:
        """A cache met for the first time: walk the stack once, and count
        it and every other cache the model's frames reach that is not met
        yet (a batched copy built by concatenation, a request's cache
        replaced by slicing: neither goes through ``Cache.update``)."""
        stack: list[str] = []
        holders: dict[int, list[str]] = {}
        found: dict[int, Cache] = {}
        frame = sys._getframe(3)  # the glue's wrapper, under _meet_from_stack <- _count <- cache_updated
        for _ in range(_FRAME_DEPTH):
            if frame is None:
                break
            local = frame.f_locals
            module = local.get("self")
            path = self._paths.get(id(module))
            if path is not None:
                stack.append(path)
                for reached in self._reachable(local, module):
                    found[id(reached)] = reached
                    paths = holders.setdefault(id(reached), [])
                    if path not in paths:
                        paths.append(path)
            _release_locals_snapshot(frame, local)
            frame = frame.f_back
        found.setdefault(id(updated), updated)
        for key, cache in found.items():
            if key in self._caches or key in self._ignored:
                continue
            self._watch(cache)
            owner = self._owner(holders.get(key, []), stack)
            if owner is None:
                self._ignored.add(key)
                continue
            tracked = self._caches[key] = _Tracked(owner)
            self._met += 1
            self._recount(tracked, cache, range(len(getattr(cache, "layers", ()) or ())))

    def _reachable(self, local: dict[str, Any], module: Any) -> list[Cache]:
        """The caches a module frame reaches: its locals (``self`` aside) and
        the module's own attributes (searched once per window: a cache put
        in an attribute later in the window is met through the frame that
        holds it in a local, or its own update); an ``EncoderDecoderCache``
        stands for its two halves, which are what ``Cache.update`` is called
        on."""
        found = [cache for name, value in local.items() if name != "self" for _, cache in caches_in(name, value)]
        attributes = self._attributes.get(id(module))
        if attributes is None:
            attributes = self._attributes[id(module)] = [cache for _, _, cache in held_caches(module)]
        found.extend(attributes)
        halves = []
        for cache in found:
            if isinstance(cache, EncoderDecoderCache):
                halves.extend((cache.self_attention_cache, cache.cross_attention_cache))
        return [cache for cache in found if not isinstance(cache, EncoderDecoderCache)] + halves

    def _owner(self, holders: list[str], stack: list[str]) -> str | None:
        """The rule of the module docstring. ``holders`` and ``stack`` are
        innermost first; None outside this model."""
        if not stack:
            return None
        if not holders:
            return stack[0]
        declaring = [path for path in holders if path in self._declaring]
        if len(declaring) == 1:
            return declaring[0]
        if not declaring:
            above = [path for path in stack if path in self._declaring]
            if above:
                return above[0]
        return holders[-1]

    def _recount(self, tracked: _Tracked, cache: Cache, indices: Any) -> None:
        layers = getattr(cache, "layers", None)
        for index in indices:
            if layers is not None and 0 <= index < len(layers):
                self._recount_layer(tracked, index, cache_layer_storages(layers[index]))

    def _recount_layer(self, tracked: _Tracked, index: int, storages: list[tuple[_StorageKey, int]]) -> None:
        for storage in tracked.layers.get(index, ()):
            self._release(storage)
        tracked.layers[index] = [storage for storage, _ in storages]
        for storage, size in storages:
            entry = self._storages.get(storage)
            if entry is None:
                self._storages[storage] = [size, 1, tracked.owner]
                self._held[tracked.owner] = self._held.get(tracked.owner, 0) + size
                self._total += size
            else:
                entry[1] += 1

    def _release(self, storage: _StorageKey) -> None:
        entry = self._storages[storage]
        entry[1] -= 1
        if entry[1] == 0:
            del self._storages[storage]
            self._held[entry[2]] -= entry[0]
            self._total -= entry[0]

    def _watch(self, cache: Cache) -> None:
        if cache not in self._watched:
            self._watched.add(cache)
            weakref.finalize(cache, self._forget, id(cache))

    def _forget(self, key: int) -> None:
        """A cache met in this window was garbage collected: its storages
        leave the count (its id may now be reused by a new cache)."""
        self._ignored.discard(key)
        tracked = self._caches.pop(key, None)
        if tracked is None:
            return
        for storages in tracked.layers.values():
            for storage in storages:
                self._release(storage)
