"""Declarations an operator supplies for a model that does not make them.

A model that declares nothing on its path is planned as holding nothing:
vLLM-Omni's Qwen3-TTS decoder declares only under CUDA graphs, while its
async-chunk path holds caches in every mode. The operator who knows what
the model holds names a preset (:mod:`.presets`) or a spec file
(:mod:`.specfile`), and those declarations are planned beside the model's
own, each marked with where it came from, so the plan and the report never
pass one off as the model's.

Entry points: :func:`supplied_collection` (what ``--model-local-kv-declarations``,
``kv-budget plan --deploy --stage-declarations`` and the setting
``declarations`` read), :func:`with_supplied`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kv_budget.collect.model import Collection
from kv_budget.collect.presets import PRESETS, preset_collection
from kv_budget.collect.specfile import SpecFileError, load_spec_file
from kv_budget.errors import KvBudgetError

__all__ = ["SuppliedDeclarationsError", "supplied_collection", "supplied_source", "with_supplied"]


class SuppliedDeclarationsError(KvBudgetError, ValueError):
    """A value that is neither a preset nor a readable spec file, or that
    declares a name the model declares too; the message says which."""


def supplied_source(value: str) -> str:
    """How the declarations of ``value`` are named in plans and reports
    (``preset NAME`` or ``spec file PATH``); raises when ``value`` is neither
    a preset name nor an existing file."""
    if value in PRESETS:
        return f"preset {value}"
    if Path(value).is_file():
        return f"spec file {value}"
    raise SuppliedDeclarationsError(f"{value!r} is neither a preset ({', '.join(PRESETS)}) nor a file")


def supplied_collection(value: str) -> Collection:
    """The declarations of preset or spec file ``value``, each marked
    ``supplied_by`` its source."""
    source = supplied_source(value)
    try:
        collection = preset_collection(value) if value in PRESETS else load_spec_file(value)
    except SpecFileError as exc:
        raise SuppliedDeclarationsError(str(exc)) from None
    return Collection(tuple(dataclasses.replace(owned, supplied_by=source) for owned in collection.specs),
                      collection.failures)


def with_supplied(model: Collection, supplied: Collection) -> Collection:
    """The model's declarations and the supplied ones. A supplied
    declaration with the owner and name of one the model makes is refused:
    planning both counts one cache twice, planning one guesses which is
    right, and an override already corrects a model's declaration."""
    declared = {(owned.owner, owned.spec.name) for owned in model.specs}
    clashes = [f"{owned.owner or '<root>'}/{owned.spec.name}" for owned in supplied.specs
               if (owned.owner, owned.spec.name) in declared]
    if clashes:
        raise SuppliedDeclarationsError(
            f"supplied declaration(s) {', '.join(clashes)} are declared by the model too; correct the model's "
            "with --model-local-kv-override instead"
        )
    return Collection(model.specs + supplied.specs, model.failures + supplied.failures)
