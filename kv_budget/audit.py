"""Check declarations against the caches a model really holds.

A declaration (:mod:`kv_budget.declare.spec`) is a promise written by hand; the
planner believes it. If it is short, the planner admits more sequences than
fit and the server dies of out-of-memory long after a "successful" start. So
this module builds the model, lets it run, finds every ``transformers`` cache
object its modules keep, counts the bytes those caches really hold, and
compares them, owner by owner, with what the owner declared.

Finding, attributing and counting are :mod:`kv_budget.sample.caches`'s (each
storage once, the storage and not the view; a cache an ancestor keeps for its
one declaring child charged to the child; a cache it cannot count fully
refused with :class:`~kv_budget.sample.caches.UnsupportedCacheError`). This
module charges each owner's declarations at the rows below and gives each
owner a verdict.

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
from typing import Any, Literal

import torch
from pydantic import BaseModel, computed_field
from transformers.cache_utils import Cache

from kv_budget.collect.model import collect_model_local_kv_specs, unwrap_model, walk_modules
from kv_budget.declare.spec import ModelLocalKVSpec, RowDriver
from kv_budget.errors import KvBudgetError
from kv_budget.sample.caches import LayerBytes, attribute_caches, cache_breakdown, held_caches
from kv_budget.units import format_bytes

__all__ = [
    "AuditError",
    "CacheEntry",
    "DeclarationEntry",
    "FailureEntry",
    "OwnerAudit",
    "AuditReport",
    "Verdict",
    "audit_module",
    "load_factory",
]

Verdict = Literal["match", "under-declared", "over-declared", "declared-but-absent", "undeclared"]
"""The five outcomes of comparing one owner's declarations with its caches."""


class AuditError(KvBudgetError, ValueError):
    """The audit cannot compute an honest figure (e.g. the row count of a
    cache cannot be read) and says why instead of guessing."""


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


def _cache_rows(layers: list[LayerBytes]) -> int | None:
    batches = {layer.batch for layer in layers if layer.batch is not None}
    if len(batches) > 1:
        raise AuditError(f"cache layers disagree on the batch dimension: {sorted(batches)}")
    if batches:
        return batches.pop()
    if sum(layer.bytes for layer in layers) == 0:
        return 0
    return None


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
    caches_of = _caches_by_owner(owners, specs_by_owner)
    seen: set[tuple[str, int | None, int]] = set()
    entries = []
    for path, _ in owners:
        caches = [_cache_entry(holder, attr, label, cache, seen)
                  for holder, attr, label, cache in caches_of.get(path, [])]
        specs = specs_by_owner.get(path, [])
        if specs or caches:
            entries.append(_owner_audit(path, specs, caches, max_num_seqs))
    failures = [FailureEntry(owner=f.owner, error=f.error) for f in collection.failures]
    return AuditReport(owners=entries, failures=failures, max_num_seqs=max_num_seqs)


def _caches_by_owner(owners: list[tuple[str, Any]], specs_by_owner: dict[str, list[ModelLocalKVSpec]],
                     ) -> dict[str, list[tuple[str, str, str, Cache]]]:
    """Each cache once, charged to its owner, seen from the owner itself
    when it holds the cache, else from its first holder."""
    held = {path: held_caches(obj) for path, obj in owners}
    holders, assigned = attribute_caches([path for path, _ in owners], held, specs_by_owner)
    caches_of: dict[str, list[tuple[str, str, str, Cache]]] = {}
    for holder, _ in owners:
        for attr, label, cache in held[holder]:
            owner = assigned[id(cache)]
            seen_from = owner if owner in holders[id(cache)] else holders[id(cache)][0]
            if holder == seen_from:
                caches_of.setdefault(owner, []).append((holder, attr, label, cache))
    return caches_of


def _cache_entry(holder: str, attr: str, label: str, cache: Cache, seen: set) -> CacheEntry:
    layers = cache_breakdown(cache, seen=seen)
    return CacheEntry(attribute=attr, held_by=holder, path=label, cache_class=type(cache).__name__,
                      rows=_cache_rows(layers), bytes=sum(layer.bytes for layer in layers), layers=layers)


def _owner_audit(path: str, specs: list[ModelLocalKVSpec], caches: list[CacheEntry],
                 max_num_seqs: int | None) -> OwnerAudit:
    """One owner's declarations at the live sequences (given, or measured from its caches) against its caches."""
    live: int | None = None
    source: Literal["argument", "measured", "none"] = "none"
    if any(spec.rows is RowDriver.MAX_NUM_SEQS for spec in specs):
        if max_num_seqs is not None:
            live, source = max_num_seqs, "argument"
        else:
            live, source = _live_sequences(path, caches), "measured"
    declarations: list[DeclarationEntry] = []
    for spec in specs:
        rows = spec.rows_fixed if spec.rows is RowDriver.FIXED else live
        assert rows is not None
        declarations.append(DeclarationEntry(name=spec.name, scope=spec.scope.value, rows_driver=spec.rows.value,
                                             bytes_per_row=spec.bytes_per_row, rows=rows,
                                             bytes=spec.bytes_per_row * rows))
    declared = sum(d.bytes for d in declarations)
    measured = sum(c.bytes for c in caches)
    return OwnerAudit(owner=path, verdict=_verdict(bool(specs), bool(caches), declared, measured),
                      declarations=declarations, declared_bytes=declared, measured_bytes=measured,
                      live_sequences=live, rows_source=source, caches=caches)


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
