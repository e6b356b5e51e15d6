"""The per-device ledger that engines sharing a device plan against.

Each engine plans from a sample of free memory (or an operator's headroom)
taken after its own paged pool exists. Two engines with model-local KV on
one device each see the same free memory and each plan to fill it; vLLM-Omni
starts its stages on one GPU one after another, so an early stage also sees
memory that a later one will claim. Neither can be fixed inside one engine.

So every engine records, per device, the model-local bytes it reserved (its
predicted peak at the ``max_num_seqs`` it runs with), in a small JSON file in
a runtime directory, under an exclusive ``flock`` of kv-budget's own. An
engine planning later holds the same lock while it reads the others'
reservations, plans against its headroom minus them, and records its own,
so two engines can never both plan against the same bytes. Entries of
processes that are gone (checked by pid and process start time, so a
recycled pid does not keep a dead engine's reservation) are dropped when the
file is next read.

The lock is never vLLM-Omni's ``/tmp/vllm_omni_device_<id>_init.lock``: its
orchestrator holds that one while a stage starts, and taking it from inside
the stage would deadlock. Locks are always taken in sorted device order, so
two engines spanning the same devices cannot deadlock each other.

Entry point: :func:`open_ledger`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from kv_budget.errors import KvBudgetError
from kv_budget.runtime_files import exclusive_lock, write_atomically

__all__ = [
    "LEDGER_DIR_ENV",
    "LedgerError",
    "Reservation",
    "LedgerSession",
    "default_ledger_dir",
    "open_ledger",
    "process_alive",
    "this_process",
]

LEDGER_DIR_ENV = "KV_BUDGET_LEDGER_DIR"
"""Overrides the default runtime directory (tests give each run its own)."""


class LedgerError(KvBudgetError, RuntimeError):
    """The ledger directory or a ledger file cannot be used; the message says
    which path and how to choose another."""


@dataclass(frozen=True)
class Reservation:
    """One engine's model-local bytes on one device."""

    device: str
    pid: int
    process_start: float
    """``psutil.Process(pid).create_time()``: with the pid, identifies the
    process even after the pid is recycled."""
    engine: str
    """Who holds it, for the plan table ("pid 123: model /models/x")."""
    reserved_bytes: int
    recorded_at: float


def default_ledger_dir() -> Path:
    """``$KV_BUDGET_LEDGER_DIR``, else ``$XDG_RUNTIME_DIR/kv-budget``, else
    ``/tmp/kv-budget-<uid>``: per user, like other runtime state."""
    explicit = os.environ.get(LEDGER_DIR_ENV)
    if explicit:
        return Path(explicit)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "kv-budget"
    return Path(tempfile.gettempdir()) / f"kv-budget-{os.getuid()}"


def _file_stem(device: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", device)


def process_alive(pid: int, process_start: float) -> bool:
    """The same process still runs: same pid, same start time, not a zombie
    (a killed engine whose parent died stays a zombie in a container whose
    first process reaps nothing)."""
    try:
        process = psutil.Process(pid)
        return abs(process.create_time() - process_start) < 0.01 and process.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def this_process() -> tuple[int, float]:
    pid = os.getpid()
    return pid, psutil.Process(pid).create_time()


class LedgerSession:
    """The ledgers of some devices, read under their locks. Reservations of
    other live processes are visible; this process's earlier ones (a second
    plan) and dead processes' are already dropped."""

    def __init__(self, directory: Path, entries: dict[str, list[Reservation]]) -> None:
        self.directory = directory
        self._entries = entries

    def others(self, device: str) -> list[Reservation]:
        return list(self._entries[device])

    def record(self, device: str, engine: str, reserved_bytes: int) -> Reservation:
        """Write this process's reservation on ``device`` (replacing any
        earlier one of it), atomically."""
        if reserved_bytes < 0:
            raise ValueError(f"reserved_bytes={reserved_bytes} is negative")
        pid, start = this_process()
        mine = Reservation(device, pid, start, engine, reserved_bytes, time.time())
        entries = [*self._entries[device], mine]
        path = self.directory / f"{_file_stem(device)}.json"
        try:
            write_atomically(path, json.dumps([asdict(e) for e in entries], indent=1))
        except OSError as exc:
            raise LedgerError(f"cannot write the kv-budget ledger {path}: {exc.strerror or exc}") from exc
        self._entries[device] = entries[:-1]
        return mine


def _read(path: Path, device: str) -> list[Reservation]:
    """Live entries of other processes; an unreadable file is an error (a
    ledger silently treated as empty would let two engines share bytes)."""
    if not path.exists():
        return []
    try:
        raw = json.loads(path.read_text() or "[]")
        entries = [Reservation(**item) for item in raw]
    except (OSError, ValueError, TypeError) as exc:
        raise LedgerError(
            f"the kv-budget ledger {path} cannot be read ({exc}); remove it once no engine runs on {device}"
        ) from exc
    me = os.getpid()
    return [e for e in entries if e.pid != me and process_alive(e.pid, e.process_start)]


@contextlib.contextmanager
def open_ledger(directory: Path, devices: list[str]) -> Iterator[LedgerSession]:
    """Lock the ledgers of ``devices`` (sorted, so concurrent engines cannot
    deadlock), read them, and keep them locked until the block ends: plan
    and :meth:`LedgerSession.record` inside it."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        probe = directory / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise LedgerError(
            f"the kv-budget ledger directory {directory} cannot be used ({exc.strerror or exc}); "
            f"choose another with --model-local-kv-ledger-dir or ${LEDGER_DIR_ENV}, or turn the ledger off "
            "with --model-local-kv-ledger-dir off"
        ) from exc
    with contextlib.ExitStack() as stack:
        entries: dict[str, list[Reservation]] = {}
        for device in sorted(set(devices)):
            stack.enter_context(exclusive_lock(directory / f"{_file_stem(device)}.lock"))
            entries[device] = _read(directory / f"{_file_stem(device)}.json", device)
        yield LedgerSession(directory, entries)
