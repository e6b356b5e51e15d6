"""What a held sequence cost the device when this engine last served, kept for its next start.

The live watch measures what one held sequence costs the device (what it
lost since startup, per sequence held: :mod:`kv_budget.watch.live`). The
first burst is admitted before any sample, so it rests on a guess: the
declared bytes plus the margin's growth part read per sequence. Where the
load is short (every request served before a second sample), that guess is
the limit. So each engine writes the cost it measured at the most sequences
it held, and the next start of the same engine on this host admits its first
burst at that cost (:func:`kv_budget.watch.live.first_admission`): a measured
per-sequence cost, as an operator's bisection measures it, without the runs
the OOM killer ends.

One file per engine, named by a hash of its fingerprint (the glue's:
model, dtype, lengths, batch limits, parallel sizes, the declared bytes per
sequence, vLLM's and kv-budget's versions), the fingerprint stored whole in
it: a file whose fingerprint differs is another engine's and is not used.

Trust: a record makes an engine admit more than the guess would, so only
the engine's own user may write it: the directory is private
(:func:`kv_budget.runtime_files.checked_dir`, never a group's), each file a
regular file of this user, never followed through a link. A file that is
not what an engine writes is set aside with one warning and the first burst
is the guess; a record never stops an engine from starting, and the live
watch still lowers the limit on what the device shows.

Entry points: :func:`read_cost_record`, :func:`write_cost_record`.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kv_budget.ledger import default_ledger_dir
from kv_budget.log import logger
from kv_budget.runtime_files import UnsafeRuntimeDirError, checked_dir, read_text, write_atomically
from kv_budget.settings import COST_RECORD_OFF

__all__ = [
    "HeldCost",
    "CostRecord",
    "cost_record_directory",
    "cost_record_path",
    "read_cost_record",
    "write_cost_record",
]

MAX_RECORD_BYTES = 64 * 1024
"""The most a record file may hold: one engine's fingerprint and one figure
per rank is well under a kilobyte."""

MAX_SEQUENCES = 1 << 20
MAX_COST_BYTES = 1 << 50
"""Bounds of a figure an engine writes: more sequences than any scheduler
runs, more bytes per sequence than any device holds, are not an engine's."""

CHOOSE_ANOTHER = "choose another with --model-local-kv-cost-record DIR, or turn it off with --model-local-kv-cost-record off"


class HeldCost(BaseModel):
    """What one rank's device lost per held sequence, at the most sequences held at a sample."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    most_held: int = Field(ge=1, le=MAX_SEQUENCES)
    """The most sequences held at a sample of that serve: the cost is an
    average over them, the engine's own growth under load included, so it
    is at least what one more sequence costs while that growth is spread
    over more."""
    cost_per_seq_bytes: int = Field(ge=1, le=MAX_COST_BYTES)


class CostRecord(BaseModel):
    """One engine's record: its fingerprint and, per rank, its measured cost."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine: dict[str, str]
    """The fingerprint, whole: the file name is only its hash."""
    ranks: dict[int, HeldCost]
    written_at: float
    """Seconds since the epoch, for the log line that uses it."""


def cost_record_directory(setting: str | None) -> Path | None:
    """The directory ``--model-local-kv-cost-record`` names: None where it
    is ``off``, the default runtime directory where it is not given."""
    if setting == COST_RECORD_OFF:
        return None
    return Path(setting) if setting else default_ledger_dir()


def cost_record_path(directory: Path, engine: dict[str, str]) -> Path:
    """The record file of the engine with fingerprint ``engine`` in ``directory``."""
    digest = hashlib.sha256(json.dumps(engine, sort_keys=True).encode()).hexdigest()[:24]
    return directory / f"cost-{digest}.json"


def _set_aside(path: Path, why: str) -> None:
    aside = path.with_name(f"{path.name}.corrupt-{time.time_ns()}")
    try:
        os.replace(path, aside)
    except OSError as exc:
        logger.warning("the cost record %s is not one an engine writes (%s) and could not be moved aside (%s); "
                       "the first burst is admitted at the declared bytes and the margin", path, why,
                       exc.strerror or exc)
        return
    logger.warning("the cost record %s is not one an engine writes (%s): moved to %s; the first burst is admitted "
                   "at the declared bytes and the margin", path, why, aside.name)


def read_cost_record(directory: Path, engine: dict[str, str]) -> CostRecord | None:
    """The record of this engine in ``directory``; None where there is none
    or it cannot be used (one warning, naming the file and why)."""
    try:
        path = cost_record_path(checked_dir(directory, CHOOSE_ANOTHER), engine)
    except UnsafeRuntimeDirError as exc:
        logger.warning("no cost record is read: %s", exc)
        return None
    try:
        text = read_text(path, limit=MAX_RECORD_BYTES)
    except UnicodeDecodeError:
        _set_aside(path, "not UTF-8")
        return None
    except OSError as exc:
        logger.warning("the cost record %s cannot be read (%s); the first burst is admitted at the declared bytes "
                       "and the margin; remove it, or %s", path, exc.strerror or exc, CHOOSE_ANOTHER)
        return None
    if text is None:
        return None
    try:
        record = CostRecord.model_validate_json(text)
    except ValidationError as exc:
        _set_aside(path, f"{exc.error_count()} invalid field(s): {exc.errors()[0]['msg']}")
        return None
    if record.engine != engine:
        _set_aside(path, "another engine's fingerprint")
        return None
    return record


def write_cost_record(directory: Path, engine: dict[str, str], ranks: dict[int, HeldCost]) -> Path:
    """Write this engine's record (whole, replacing the last); returns its
    path. Raises ``OSError`` for the file, :class:`UnsafeRuntimeDirError`
    for the directory, for the caller to report once."""
    path = cost_record_path(checked_dir(directory, CHOOSE_ANOTHER), engine)
    record = CostRecord(engine=engine, ranks=ranks, written_at=time.time())
    write_atomically(path, record.model_dump_json())
    return path
