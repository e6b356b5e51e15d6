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
declarers that use it; kv-budget must take their declarations exactly as
they are made. So the names, field order, defaults and documented semantics
here are vLLM-Omni's: ``ModelLocalKVSpec``, ``ModelLocalKVScope``,
``RowDriver``, ``spec_from_hf_config``, ``collect_model_local_kv_specs`` and
``HasModelLocalKV`` can replace its imports unchanged, and
:func:`normalize_spec` reads a declaration object of vLLM-Omni's own class (or
any class with the same attribute names) by the same rules. An earlier
revision refused ``rows_fixed`` beside ``rows=max_num_seqs``; vLLM-Omni's
class defaults ``rows_fixed`` to 1 and documents it as ignored there, so
every per-sequence declaration it makes was refused and the plan ran with
zero per-sequence bytes. A refusal drops bytes from the plan, so this module
refuses only what vLLM-Omni refuses too (a fixed count below 1 or without a
reason) and what makes the byte count impossible to compute (geometry that
is not a positive int, a dtype that is not a ``torch.dtype``, an unknown
scope or row driver), and always says why.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol, runtime_checkable

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "Scope",
    "ModelLocalKVScope",
    "RowDriver",
    "ModelLocalKVSpec",
    "InvalidDeclarationError",
    "SPEC_FIELDS",
    "OPTIONAL_SPEC_FIELDS",
    "HasModelLocalKV",
    "OwnedSpec",
    "DeclarerFailure",
    "Collection",
    "normalize_spec",
    "unwrap_model",
    "walk_modules",
    "spec_from_hf_config",
    "collect_model_local_kv_specs",
    "COLLECTION_TIME_LIMIT_S",
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


class InvalidDeclarationError(ValueError):
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


_LOOKUP_NAMES = {
    "decoder": {
        "layers": ("decoder_layers", "num_decoder_layers", "num_hidden_layers", "n_layer", "num_layers", "n_layers"),
        "heads": ("decoder_attention_heads", "num_attention_heads", "n_head", "num_heads"),
        "kv_heads": ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num"),
        "hidden": ("hidden_size", "n_embd", "d_model"),
    },
    "encoder": {
        "layers": ("encoder_layers", "num_encoder_layers", "encoder_num_hidden_layers"),
        "heads": ("encoder_attention_heads", "encoder_num_attention_heads"),
        "kv_heads": ("encoder_num_key_value_heads",),
        "hidden": ("d_model", "encoder_hidden_size", "hidden_size"),
    },
}
"""Attribute names tried, in order, per stack. Decoder and encoder are asked
for explicitly: a Whisper config has both ``decoder_layers`` and
``encoder_layers``, and picking whichever is found first is a guess. The
stack-specific names come first, and generic names that the config's
``attribute_map`` aliases to the other stack are skipped: ``WhisperConfig``
maps ``num_hidden_layers`` and ``num_key_value_heads`` to the *encoder*, and
reading them declared the decoder with the encoder's geometry."""


def _lookup(config: Any, names: Iterable[str], stack: str) -> tuple[str, int] | None:
    """First integer attribute among ``names``, skipping generic names that
    the config's ``attribute_map`` aliases to the *other* stack (Whisper maps
    ``num_key_value_heads`` to ``encoder_attention_heads``)."""
    other = "decoder" if stack == "encoder" else "encoder"
    aliases = getattr(config, "attribute_map", None) or {}
    for attr in names:
        if str(aliases.get(attr, attr)).startswith(other):
            continue
        value = getattr(config, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return attr, value
    return None


_STACK_LAYER_NAMES = {
    "decoder": ("decoder_layers", "num_decoder_layers"),
    "encoder": _LOOKUP_NAMES["encoder"]["layers"],
}
"""Layer counts only a stack of that kind has: a config with both is an
encoder-decoder config, whose generic names could mean either stack."""


def _pick_stack(config: Any, name: str) -> str:
    """The stack to read when the caller named none: the decoder, unless
    the config has only an encoder. A config with both is refused: vLLM-Omni's
    own helper would read the encoder there (Whisper aliases the generic
    names to it) and a decoder-first lookup the decoder, and which one a
    declarer meant cannot be known."""
    has = {
        stack: _lookup(config, names, stack) is not None for stack, names in _STACK_LAYER_NAMES.items()
    }
    if has["decoder"] and has["encoder"]:
        raise ValueError(
            f"spec_from_hf_config({name!r}): {type(config).__name__} has an encoder and a decoder "
            "stack; pass stack='encoder' or stack='decoder' (or layers, kv_heads and head_dim)"
        )
    return "encoder" if has["encoder"] else "decoder"


def _geometry_from_config(config: Any, name: str, stack: str) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) looked up in ``config`` for ``stack``."""
    if stack not in _LOOKUP_NAMES:
        raise ValueError(f"stack {stack!r} is not one of {sorted(_LOOKUP_NAMES)}")
    names = _LOOKUP_NAMES[stack]
    kind = type(config).__name__

    def need(what: str) -> tuple[str, int]:
        found = _lookup(config, names[what], stack)
        if found is None:
            raise ValueError(
                f"spec_from_hf_config({name!r}): {kind} has no {stack} {what} count; "
                f"tried attributes {list(names[what])}"
            )
        return found

    _, layers = need("layers")
    _, heads = need("heads")
    kv_found = _lookup(config, names["kv_heads"], stack)
    if kv_found is not None:
        kv_heads = kv_found[1]
    elif getattr(config, "multi_query", False) is True:
        kv_heads = 1
    else:
        kv_heads = heads
    head_dim = getattr(config, "head_dim", None) if stack == "decoder" else None
    if not isinstance(head_dim, int) or isinstance(head_dim, bool):
        hidden_attr, hidden = need("hidden")
        if heads < 1 or hidden % heads:
            raise ValueError(
                f"spec_from_hf_config({name!r}): {kind}.{hidden_attr}={hidden} is not "
                f"divisible by {heads} heads and the config has no head_dim"
            )
        head_dim = hidden // heads
    return layers, kv_heads, head_dim


def spec_from_hf_config(
    config: Any,
    *,
    name: str,
    physical_capacity_positions: int,
    capacity_source: str,
    scope: Scope | str,
    dtype: torch.dtype,
    rows: RowDriver | str,
    rows_fixed: int = 1,
    rows_reason: str = "",
    allocation_note: str | None = None,
    layers: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    stack: str | None = None,
) -> ModelLocalKVSpec:
    """Build a declaration from the same Hugging Face config the cache is
    built from, so the two cannot drift apart.

    vLLM-Omni's signature, plus ``stack``. ``rows`` is keyword-required: the
    multiplicity is the part most often wrong, and a default would hide that
    nobody thought about it. ``layers``, ``kv_heads`` and ``head_dim``, when
    given, are used as given (a declarer may know the built module better
    than the config); the others are looked up under the usual attribute
    names of the ``stack`` ("decoder" or "encoder"; by default the decoder,
    or the encoder of an encoder-only config, and refused for a config that
    has both). ``head_dim`` is the config's own when it has one, else
    hidden / heads, which must divide exactly. With no key/value head count
    in the config, attention is multi-head (kv heads == heads), except that
    ``multi_query=True`` means one. Anything not found raises, naming every
    attribute tried.
    """
    if layers is None or kv_heads is None or head_dim is None:
        found = _geometry_from_config(config, name, stack or _pick_stack(config, name))
        layers = found[0] if layers is None else layers
        kv_heads = found[1] if kv_heads is None else kv_heads
        head_dim = found[2] if head_dim is None else head_dim
    return ModelLocalKVSpec(
        name=name,
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        physical_capacity_positions=physical_capacity_positions,
        capacity_source=capacity_source,
        scope=scope,  # type: ignore[arg-type]  # validated and converted in __post_init__
        rows=rows,  # type: ignore[arg-type]
        rows_fixed=rows_fixed,
        rows_reason=rows_reason,
        allocation_note=allocation_note,
    )


@dataclass(frozen=True)
class OwnedSpec:
    """A declaration and the module path of the object that made it ("" is
    the root), so a log line can point at the code that owns the cache."""

    owner: str
    spec: ModelLocalKVSpec
    overridden: tuple[tuple[str, Any, Any], ...] = ()
    """(field, declared value, applied value) for each field an operator
    corrected (:mod:`kv_budget.overrides`), so a report shows both."""


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
        logger.warning("model_local_kv_specs() of %s did not return within %g s; it and %d owner(s) not asked "
                       "yet are recorded as failures", slow or "<root>", time_limit_s, len(owners) - asking - 1)
    return Collection(tuple(_distinct_names(specs)), tuple(failures))
