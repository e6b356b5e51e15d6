"""The one way the glue changes vLLM: :func:`patch_method`.

Every hook replaces one attribute of one vLLM class with a wrapper around
the original. vLLM may call the plugin's ``register`` several times in one
process, so a patch must be idempotent: the wrapper carries
:data:`PATCH_MARK`, and a marked attribute is left alone. It also keeps
the original as ``__wrapped__``, which ``compat`` reads so that its
signature checks mean the same before and after patching.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

PATCH_MARK = "_kv_budget_patch"
"""Set on every wrapper this package installs."""


def patch_method(owner: type, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``owner.name`` by ``wrap(original)`` unless it is already
    patched. A staticmethod or classmethod stays one: ``wrap`` receives and
    returns the plain function."""
    stored = inspect.getattr_static(owner, name)
    descriptor = type(stored) if isinstance(stored, (staticmethod, classmethod)) else None
    original = stored.__func__ if descriptor else stored
    if getattr(original, PATCH_MARK, False):
        return
    wrapper = wrap(original)
    setattr(wrapper, PATCH_MARK, True)
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(owner, name, descriptor(wrapper) if descriptor else wrapper)
