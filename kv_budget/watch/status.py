"""The engine's status file: how the API-server process learns the plan and
the live figures of an engine core it does not share memory with.

vLLM runs the engine core in a process of its own, and with
``--api-server-count`` > 1 several API-server processes serve one engine;
none of them sees the engine core's objects, and vLLM has no channel for a
plugin's data between them. A file does: the engine core rewrites its status
after planning and after every live sample (an atomic rename, so a reader
never sees half a file), and each API-server process reads it when it
refreshes its metrics.

Where: the directory named by :data:`STATUS_DIR_ENV`. The first process to
load the plugin without it (the API server, or ``vllm serve``'s launcher)
creates a private temporary directory and sets the variable; every process
it starts after that (engine cores, workers, further API servers) inherits
it, as vLLM's own ``PROMETHEUS_MULTIPROC_DIR`` is inherited. One file per
engine: ``engine-{index}-{digest}.json``, the digest of the model name, so
engines of different models sharing the directory do not overwrite each
other; a vLLM-Omni stage adds its stage and replica
(``engine-{index}-stage{S}-replica{R}-{digest}.json``), since the stages of
one deployment often serve one model.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pydantic import BaseModel, ValidationError

from kv_budget.deployment import StageSplit
from kv_budget.plan.planner import Plan
from kv_budget.runtime_files import checked_dir, read_text, write_atomically
from kv_budget.stage import Stage
from kv_budget.watch.live_state import LiveState

__all__ = ["STATUS_DIR_ENV", "EngineStatus", "status_path", "stage_status_paths", "write_status", "read_status"]

STATUS_DIR_ENV = "KV_BUDGET_STATUS_DIR"


class EngineStatus(BaseModel):
    """One engine's plan and live figures, as its frontends read them."""

    engine_index: int
    model: str
    pid: int
    """The engine-core process that wrote it."""
    updated_unix_s: float
    plan: Plan
    live: LiveState | None = None
    """None until the first sample (and under policies that do not sample)."""
    stage: Stage | None = None
    """The vLLM-Omni stage and replica; None for a plain vLLM engine."""
    overrides: list[str] = []
    """The operator's overrides that applied to this engine (unqualified
    ones and its stage's), as given."""
    unmatched_overrides: list[str] = []
    """Those of them that matched no declaration here: a vLLM-Omni driver
    stops the deployment when one matched in no stage."""
    deployment: StageSplit | None = None
    """The stage's part of its vLLM-Omni deployment's devices
    (:mod:`kv_budget.deployment`); None outside one."""


def status_path(directory: str | Path, model: str, engine_index: int, stage: Stage | None = None) -> Path:
    digest = hashlib.sha256(model.encode()).hexdigest()[:12]
    staged = f"{stage.tag()}-" if stage is not None else ""
    return Path(directory) / f"engine-{engine_index}-{staged}{digest}.json"


def stage_status_paths(directory: str | Path, engine_index: int | None = None,
                       stage: Stage | None = None) -> list[Path]:
    """The status files of vLLM-Omni stage engines in ``directory``, oldest
    first: every stage's, or those of one engine index of one stage (a
    frontend's: another stage may serve another model, so the digest is
    not known there). Named as :func:`status_path` names them."""
    index = "*" if engine_index is None else str(engine_index)
    staged = "stage*" if stage is None else stage.tag()
    found = []
    for path in Path(directory).glob(f"engine-{index}-{staged}-*.json"):
        try:
            found.append((path.lstat().st_mtime_ns, path))
        except FileNotFoundError:  # replaced between the listing and the look
            continue
    return [path for _, path in sorted(found)]


def write_status(directory: str | Path, status: EngineStatus) -> Path:
    """Write atomically (temporary file, then rename) in ``directory``,
    created private where missing and refused where it is not this user's
    alone (:func:`kv_budget.runtime_files.checked_dir`); return the path."""
    path = status_path(directory, status.model, status.engine_index, status.stage)
    checked_dir(path.parent, f"set ${STATUS_DIR_ENV} to a directory of this user's alone")
    write_atomically(path, status.model_dump_json())
    return path


def read_status(path: str | Path) -> EngineStatus | None:
    """The status at ``path``; None when there is none yet. A file that is
    not a status raises ``ValueError`` naming it: something else wrote there;
    a link or a file kv-budget may not trust raises ``OSError``
    (:func:`kv_budget.runtime_files.read_text`)."""
    try:
        text = read_text(Path(path))
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a kv-budget engine status (not UTF-8)") from None
    if text is None:
        return None
    try:
        return EngineStatus.model_validate(json.loads(text))
    except (ValueError, ValidationError) as exc:
        raise ValueError(f"{path}: not a kv-budget engine status ({type(exc).__name__})") from None
