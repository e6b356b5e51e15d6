"""The one hook inside ``transformers``: ``Cache.update`` tells the active
in-step tracker (:class:`kv_budget.sample.in_step.InStepTracker`) of each
update, so a sampled engine step sees the caches that live only inside it.

Why ``Cache.update``: in ``transformers`` 5.x every attention layer grows a
cache through it (``EncoderDecoderCache`` hands each half to its own
``Cache``), and no subclass overrides it; :func:`check_cache_update` holds
both to the installed version before the wrapper goes in, and says why
in-step measurement is off when they do not hold.

The wrapper costs one global read per update when no tracker is active,
and nothing inside code torch.compile traces: it returns the original's
result before reading the tracker there, so no guard is placed on it.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import cache_utils

from kv_budget.sample.in_step import InStepTracker
from vllm_patches.patching import PATCH_MARK, patch_method

__all__ = ["check_cache_update", "install", "tracking", "start", "stop"]

_active: InStepTracker | None = None
"""The tracker of this process's current window; None between windows."""


def _subclasses(cls: type) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        found.append(sub)
        found.extend(_subclasses(sub))
    return found


def check_cache_update() -> str | None:
    """Why the wrapper cannot see every update, or None when it can."""
    update = inspect.getattr_static(cache_utils.Cache, "update", None)
    if update is None:
        return "transformers' Cache has no update method"
    original = getattr(update, "__wrapped__", update) if getattr(update, PATCH_MARK, False) else update
    parameters = list(inspect.signature(original).parameters)
    if parameters[:4] != ["self", "key_states", "value_states", "layer_idx"]:
        return f"transformers' Cache.update takes {parameters}, not (self, key_states, value_states, layer_idx, ...)"
    overriding = [sub.__qualname__ for sub in _subclasses(cache_utils.Cache) if "update" in vars(sub)]
    if overriding:
        return f"{', '.join(overriding)} override Cache.update; their updates would not be seen"
    return None


def _wrap_update(original):
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        result = original(self, key_states, value_states, layer_idx, *args, **kwargs)
        if torch.compiler.is_compiling():
            return result
        tracker = _active
        if tracker is not None:
            tracker.cache_updated(self, layer_idx)
        return result

    return update


def install() -> str | None:
    """Wrap ``Cache.update`` once; returns why it cannot (nothing is then wrapped)."""
    problem = check_cache_update()
    if problem is None:
        patch_method(cache_utils.Cache, "update", _wrap_update)
    return problem


@contextmanager
def tracking(tracker: InStepTracker) -> Iterator[InStepTracker]:
    """``tracker`` sees every update inside the block (:func:`install` first)."""
    start(tracker)
    try:
        yield tracker
    finally:
        stop()


def start(tracker: InStepTracker) -> None:
    """Open a window that outlives the call (the engine step runs between
    two RPCs); :func:`stop` closes it."""
    global _active
    tracker.begin()
    _active = tracker


def stop() -> InStepTracker | None:
    """Close the open window; returns its tracker (None when none was open)."""
    global _active
    tracker, _active = _active, None
    return tracker
