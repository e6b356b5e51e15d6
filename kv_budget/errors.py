"""The one base of every error kv-budget raises on purpose.

An operator (or a caller) can catch everything kv-budget refuses with as
one type; each subclass keeps the built-in base it always had (``ValueError``
for bad input, ``RuntimeError`` for a state it cannot plan in, ``TypeError``
for a cache kind it cannot count), so existing handlers keep working. Every
message names what was found and what to do about it.
"""

from __future__ import annotations

__all__ = ["KvBudgetError", "ModelLocalKVInfeasibleError"]


class KvBudgetError(Exception):
    """Raised by kv-budget on purpose; the message says what to do."""


class ModelLocalKVInfeasibleError(KvBudgetError, RuntimeError):
    """Under ``cap``, not even one sequence's model-local KV fits: the
    engine refuses to start rather than fail on the first requests."""
