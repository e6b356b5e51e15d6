"""The collect step: every declaration a loaded model makes.

:func:`collect_model_local_kv_specs` walks the model vLLM loaded (through
runner wrappers), asks each module that can declare
(``model_local_kv_specs()``, vLLM-Omni's method name), and returns a
:class:`Collection` of the declarations with the module path that made
each, and of every declarer that failed, by name. It runs at every engine
start, so it asks in a worker thread against a time limit: a declarer that
blocks fails by name instead of hanging the start. It never raises for a
declarer's bug: reporting must never break model load.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kv_budget.declare.spec import InvalidDeclarationError, ModelLocalKVSpec, normalize_spec
from kv_budget.log import logger


__all__ = [
    "OwnedSpec",
    "DeclarerFailure",
    "Collection",
    "unwrap_model",
    "walk_modules",
    "collect_model_local_kv_specs",
    "COLLECTION_TIME_LIMIT_S",
]


@dataclass(frozen=True)
class OwnedSpec:
    """A declaration and the module path of the object that made it ("" is
    the root), so a log line can point at the code that owns the cache."""

    owner: str
    spec: ModelLocalKVSpec
    overridden: tuple[tuple[str, Any, Any], ...] = ()
    """(field, declared value, applied value) for each field an operator
    corrected (:mod:`kv_budget.override`), so a report shows both."""
    supplied_by: str | None = None
    """None: the model declared it; else where the operator's declaration
    came from (``preset NAME``, ``spec file PATH``; :mod:`.supplied`)."""


@dataclass(frozen=True)
class DeclarerFailure:
    """A declarer that raised or returned something unusable. Kept, never
    dropped: a failure that vanishes looks exactly like a model that holds
    nothing."""

    owner: str
    error: str


@dataclass(frozen=True)
class Collection:
    """What the collector found: valid declarations and named failures.

    Iterates as ``(owner, spec)`` pairs, which is what vLLM-Omni's collector
    returns, so code written against it (``for path, spec in
    collect_model_local_kv_specs(model)``) runs unchanged; the failures,
    which vLLM-Omni only logs, stay available here."""

    specs: tuple[OwnedSpec, ...]
    failures: tuple[DeclarerFailure, ...]

    def __iter__(self) -> Iterator[tuple[str, ModelLocalKVSpec]]:
        return ((owned.owner, owned.spec) for owned in self.specs)

    def __len__(self) -> int:
        return len(self.specs)


def unwrap_model(model: Any) -> Any:
    """Follow ``unwrap()`` through runner wrappers (CUDA-graph and compile
    wrappers expose it) until an object stops unwrapping to something new."""
    seen = {id(model)}
    while callable(getattr(type(model), "unwrap", None)):
        inner = model.unwrap()
        if inner is None or id(inner) in seen:
            break
        seen.add(id(inner))
        model = inner
    return model


_DECLARER = "model_local_kv_specs"

_NEVER, _ALWAYS, _ASK = 0, 1, 2


def _declarer_kind(cls: type) -> int:
    """Whether instances of ``cls`` declare: always (the class has the
    method), never (unless set on the instance), or ask (a ``__getattr__``
    of the class's own could serve it)."""
    if hasattr(cls, _DECLARER):
        return _ALWAYS
    if issubclass(cls, torch.nn.Module) and cls.__getattr__ is torch.nn.Module.__getattr__:
        return _NEVER
    return _ASK


def walk_modules(root: Any) -> list[tuple[str, Any]]:
    """(path, module) for the root and every submodule (``named_modules()``:
    pre-order, each module object once, first path wins); a root that is
    not a Module is the only entry, with path ""."""
    if isinstance(root, torch.nn.Module):
        return list(root.named_modules())
    return [("", root)]


def _declaring_modules(root: Any) -> list[tuple[str, Any]]:
    """The (path, module) pairs of :func:`walk_modules` that may declare,
    in the same order, without its cost.

    Most modules declare nothing, and the collector runs at every engine
    start over models of 1e5 modules. ``named_modules()`` builds a path
    string for every module and yields through one generator per level of
    nesting; ``getattr(module, name, None)`` on a module that lacks the name
    raises and discards an AttributeError inside ``Module.__getattr__``.
    Together they took about 216 ms over 1e5 modules. This pass asks each
    class once, checks the instance dict for a declarer set on an instance,
    and joins a path only for the modules it keeps.
    """
    if not isinstance(root, torch.nn.Module):
        return [("", root)]
    kinds: dict[type, int] = {}
    seen = {id(root)}
    names: list[str] = []
    found: list[tuple[str, Any]] = []

    def visit(module: torch.nn.Module) -> None:
        cls = type(module)
        kind = kinds.get(cls)
        if kind is None:
            kind = kinds[cls] = _declarer_kind(cls)
        if kind != _NEVER or _DECLARER in module.__dict__:
            found.append((".".join(names), module))
        for name, child in module._modules.items():  # what named_modules() reads
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                names.append(name)
                visit(child)
                names.pop()

    visit(root)
    return found


COLLECTION_TIME_LIMIT_S = 30.0
"""How long the declarers of one model may take together, in seconds.
Declarers are arithmetic on config values and return in microseconds; one
that blocks (a lock, a device synchronisation, a remote call) would hold the
engine's start inside the planning RPC with nothing in the log. Past the
limit the owner being asked, and every owner not asked yet, is a named
failure; what was collected before is kept."""


def _ask_owner(path: str, module: Any) -> tuple[list[OwnedSpec], list[DeclarerFailure]]:
    """One owner's declarations and failures. Never raises: any declarer
    bug is that owner's failure, and reporting must never break model load."""
    label = path or "<root>"
    try:
        # A property or __getattr__ may raise more than AttributeError:
        # that too is this owner's failure, not the engine's.
        declarer = getattr(module, _DECLARER, None)
    except Exception as exc:  # noqa: BLE001 - see above
        logger.warning("model_local_kv_specs of %s could not be read: %r; skipped", label, exc)
        return [], [DeclarerFailure(path, f"reading model_local_kv_specs raised {type(exc).__name__}: {exc}")]
    if not callable(declarer):
        return [], []
    try:
        declared = declarer()
    except Exception as exc:  # noqa: BLE001 - any declarer bug is reported, not raised
        logger.warning("model_local_kv_specs() of %s raised %r; skipped", label, exc)
        return [], [DeclarerFailure(path, f"raised {type(exc).__name__}: {exc}")]
    if declared is None or isinstance(declared, (str, bytes)) or not isinstance(declared, Iterable):
        message = f"returned {type(declared).__name__}, expected a sequence of declarations"
        logger.warning("model_local_kv_specs() of %s %s; skipped", label, message)
        return [], [DeclarerFailure(path, message)]
    specs: list[OwnedSpec] = []
    failures: list[DeclarerFailure] = []
    try:
        for item in declared:
            try:
                specs.append(OwnedSpec(path, normalize_spec(item)))
            except (InvalidDeclarationError, TypeError) as exc:
                logger.warning("declaration from %s is invalid: %s; skipped", label, exc)
                failures.append(DeclarerFailure(path, f"invalid declaration: {exc}"))
    except Exception as exc:  # noqa: BLE001 - a generator that raises part-way
        logger.warning("iterating the declarations of %s raised %r; the rest skipped", label, exc)
        failures.append(DeclarerFailure(path, f"iterating its declarations raised {type(exc).__name__}: {exc}"))
    return specs, failures


class _Progress:
    """What the declarer thread has collected, shared with the caller under
    ``lock``. Once the caller gives up (``abandoned``), a declarer that
    returns late changes nothing the caller already returned."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.abandoned = False
        self.asking = -1
        """Index of the owner being asked (in the declaring-modules list)."""
        self.specs: list[OwnedSpec] = []
        self.failures: list[DeclarerFailure] = []


def _cuda_device_of_caller() -> int | None:
    """The caller's current CUDA device, which is per thread: a declarer
    asked from the helper thread must see the worker's device, not 0."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return None


def _ask_in_order(owners: list[tuple[str, Any]], progress: _Progress, cuda_device: int | None) -> None:
    try:
        if cuda_device is not None:
            torch.cuda.set_device(cuda_device)
        for index, (path, module) in enumerate(owners):
            with progress.lock:
                if progress.abandoned:
                    return
                progress.asking = index
            specs, failures = _ask_owner(path, module)
            with progress.lock:
                if progress.abandoned:
                    return
                progress.specs.extend(specs)
                progress.failures.extend(failures)
    finally:
        progress.done.set()


def _distinct_names(specs: list[OwnedSpec]) -> list[OwnedSpec]:
    """Give a second declaration of one name in one owner the name
    ``NAME#2`` (then ``#3``...), with a warning. Both are planned: dropping
    one would plan fewer bytes than the owner holds. Left alike, they were
    one label in the report and on /metrics (one series hid the other) and
    an override naming them matched both."""
    taken = {(owned.owner, owned.spec.name) for owned in specs}
    seen: Counter[tuple[str, str]] = Counter()
    distinct = []
    for owned in specs:
        key = (owned.owner, owned.spec.name)
        seen[key] += 1
        if seen[key] > 1:
            number = seen[key]
            while (owned.owner, f"{owned.spec.name}#{number}") in taken:
                number += 1
            renamed = f"{owned.spec.name}#{number}"
            taken.add((owned.owner, renamed))
            logger.warning("%s declares %r more than once; this one is planned and reported as %r",
                           owned.owner or "<root>", owned.spec.name, renamed)
            owned = dataclasses.replace(owned, spec=dataclasses.replace(owned.spec, name=renamed))
        distinct.append(owned)
    return distinct


def collect_model_local_kv_specs(model: Any, time_limit_s: float | None = COLLECTION_TIME_LIMIT_S) -> Collection:
    """Collect every declaration in a loaded model.

    Unwraps runner wrappers, then asks each module of :func:`walk_modules`
    (``named_modules()`` order, the root included) that has
    ``model_local_kv_specs``. A declarer that raises, returns a
    non-sequence, or returns an invalid declaration is logged and recorded
    in ``failures``: reporting must never break model load, and a lost
    failure would read as "holds nothing". The declarers run in one helper
    thread, together bounded by ``time_limit_s`` (None: in this thread, no
    limit); past it, the slow owner and those not asked are failures.
    A name declared twice by one owner is made distinct (``NAME#2``).
    """
    owners = _declaring_modules(unwrap_model(model))
    if not owners:
        return Collection((), ())
    progress = _Progress()
    if time_limit_s is None:
        _ask_in_order(owners, progress, cuda_device=None)
    else:
        thread = threading.Thread(target=_ask_in_order, args=(owners, progress, _cuda_device_of_caller()),
                                  name="kv-budget-declarers", daemon=True)
        thread.start()
        progress.done.wait(time_limit_s)
    with progress.lock:
        finished = progress.done.is_set()
        progress.abandoned = True
        specs, failures, asking = list(progress.specs), list(progress.failures), progress.asking
    if not finished:
        asking = max(asking, 0)  # a limit spent before the thread asked anyone
        slow = owners[asking][0]
        failures.append(DeclarerFailure(
            slow, f"did not return within the collection's time limit of {time_limit_s:g} s"))
        failures.extend(
            DeclarerFailure(path, f"not asked: the collection's time limit of {time_limit_s:g} s was spent "
                                  f"waiting for {slow or '<root>'}")
            for path, _ in owners[asking + 1:]
        )
        logger.warning("model_local_kv_specs() of %s did not return within %g s; it and %d owner(s) "
                       "not asked yet are recorded as failures",
                       slow or "<root>", time_limit_s, len(owners) - asking - 1)
    return Collection(tuple(_distinct_names(specs)), tuple(failures))
