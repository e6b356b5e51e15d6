"""Declarations from a JSON file, for sizing a model before it is loaded.

The file is a list of objects whose keys are the protocol's field names.
``dtype`` is a torch dtype name ("bfloat16", "float16", "float32"; an
optional "torch." prefix is accepted); ``scope`` and ``rows`` are their
lowercase values. An optional ``owner`` key names the owning module path.
Unknown keys are errors: a misspelt ``rows_fixd`` silently ignored would
turn a fixed count into a missing one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from kv_budget.collect.model import Collection, OwnedSpec
from kv_budget.declare.spec import OPTIONAL_SPEC_FIELDS, SPEC_FIELDS, InvalidDeclarationError, ModelLocalKVSpec
from kv_budget.errors import KvBudgetError

__all__ = ["SpecFileError", "load_spec_file", "parse_dtype"]

_FIELDS = set(SPEC_FIELDS)


class SpecFileError(KvBudgetError, ValueError):
    """A spec file that cannot be read as declarations; names file and entry."""


def parse_dtype(name: Any) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; anything that is not a torch
    dtype name raises rather than being mapped by similarity."""
    if not isinstance(name, str):
        raise ValueError(f"dtype {name!r} is not a string")
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a torch dtype name (e.g. 'bfloat16', 'float32')")
    return value


def load_spec_file(path: str | Path) -> Collection:
    """Read a JSON list of declarations; raise :class:`SpecFileError` naming
    the file, the entry index and the problem."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise SpecFileError(f"spec file {path}: cannot read: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise SpecFileError(f"spec file {path}: not JSON: {exc}") from exc
    if not isinstance(data, list):
        raise SpecFileError(f"spec file {path}: expected a JSON list of declarations, got {type(data).__name__}")
    specs = []
    for index, entry in enumerate(data):
        where = f"spec file {path}: entry {index}"
        if not isinstance(entry, dict):
            raise SpecFileError(f"{where}: expected an object, got {type(entry).__name__}")
        unknown = sorted(set(entry) - _FIELDS - {"owner"})
        if unknown:
            raise SpecFileError(f"{where}: unknown key(s) {unknown}; known: {sorted(_FIELDS | {'owner'})}")
        values = dict(entry)
        owner = values.pop("owner", "")
        if not isinstance(owner, str):
            raise SpecFileError(f"{where}: 'owner' must be a string, got {owner!r}")
        if "dtype" in values:
            try:
                values["dtype"] = parse_dtype(values["dtype"])
            except ValueError as exc:
                raise SpecFileError(f"{where}: {exc}") from exc
        missing = sorted(_FIELDS - OPTIONAL_SPEC_FIELDS - set(values))
        if missing:
            raise SpecFileError(f"{where}: missing required key(s) {missing}")
        try:
            specs.append(OwnedSpec(owner, ModelLocalKVSpec(**values)))
        except InvalidDeclarationError as exc:
            raise SpecFileError(f"{where}: {exc}") from exc
    return Collection(specs=tuple(specs), failures=())
