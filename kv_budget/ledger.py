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

Whoever can write the ledger can make engines plan smaller or refuse to
start (by recording reservations), never plan larger than their own device
sample allows: an entry only ever takes bytes off. So the directory is
checked (:mod:`kv_budget.runtime_files`: private to the engine's user unless
the operator chose a shared one for a group), and each entry is checked on
its own: one that is not what an engine writes (negative, huge or non-integer
bytes, another device, a duplicate) is dropped with one warning per read,
and a file that does not parse blocks its device only while a process it
names still runs; otherwise it is set aside and the device planned afresh.

The lock is never vLLM-Omni's ``/tmp/vllm_omni_device_<id>_init.lock``: its
orchestrator holds that one while a stage starts, and taking it from inside
the stage would deadlock. Locks are always taken in sorted device order, so
two engines spanning the same devices cannot deadlock each other.

Entry point: :func:`open_ledger`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from kv_budget.errors import KvBudgetError
from kv_budget.log import logger
from kv_budget.runtime_files import (
    UnsafeRuntimeDirError,
    checked_dir,
    exclusive_lock,
    read_head,
    read_text,
    remove_stale_temporaries,
    write_atomically,
)

__all__ = [
    "LEDGER_DIR_ENV",
    "MAX_ENTRIES",
    "MAX_RESERVED_BYTES",
    "LedgerError",
    "Reservation",
    "LedgerSession",
    "default_ledger_dir",
    "ledger_path",
    "open_ledger",
    "process_alive",
    "process_start",
    "this_process",
]

LEDGER_DIR_ENV = "KV_BUDGET_LEDGER_DIR"
"""Overrides the default runtime directory (tests give each run its own)."""

MAX_RESERVED_BYTES = 1 << 50
"""The most one entry may reserve (1 PiB): more is no device's, so an entry
above it is not one an engine wrote."""

MAX_ENTRIES = 4096
"""The most entries a ledger file may hold: each live engine keeps one per
device; more means the file was not written by kv-budget."""

CHOOSE_ANOTHER = (
    f"choose another with --model-local-kv-ledger-dir or ${LEDGER_DIR_ENV}, or turn the ledger off "
    "with --model-local-kv-ledger-dir off"
)


class LedgerError(KvBudgetError, RuntimeError):
    """The ledger directory or a ledger file cannot be used; the message says
    which path and how to choose another."""


@dataclass(frozen=True)
class Reservation:
    """One engine's model-local bytes on one device."""

    device: str
    pid: int
    process_start: float
    """When the process started, in seconds after the host booted
    (:func:`this_process`): with the pid, identifies the process even after
    the pid is recycled."""
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


def ledger_path(directory: Path, device: str) -> Path:
    """The ledger file of ``device`` in ``directory`` (its lock: the same with ``.lock``)."""
    return directory / f"{_file_stem(device)}.json"


def process_alive(pid: int, process_start: float) -> bool:
    """The same process still runs: same pid, same start time, not a zombie
    (a killed engine whose parent died stays a zombie in a container whose
    first process reaps nothing)."""
    try:
        process = psutil.Process(pid)
        return (abs(_started_after_boot(process) - process_start) < 0.01
                and process.status() != psutil.STATUS_ZOMBIE)
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
        return False


def this_process() -> tuple[int, float]:
    """This process's pid and start time, as :class:`Reservation` records them."""
    pid = os.getpid()
    return pid, process_start(pid)


def process_start(pid: int) -> float:
    """The start time :class:`Reservation` records for ``pid``."""
    return _started_after_boot(psutil.Process(pid))


def _started_after_boot(process: psutil.Process) -> float:
    """Seconds from boot to the process's start. On Linux the kernel's own
    figure (``/proc/<pid>/stat``, in clock ticks), which no change of the
    wall clock moves: ``create_time()`` adds the boot time, which the
    kernel derives from the wall clock, so an NTP step or slew across a
    second boundary would make a live engine look like a recycled pid and
    drop its reservation."""
    if sys.platform.startswith("linux"):
        stat = Path(f"/proc/{process.pid}/stat").read_text()
        # Fields after the command name, which may hold spaces and parentheses; starttime is field 22.
        return int(stat.rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    return process.create_time() - psutil.boot_time()


class LedgerSession:
    """The ledgers of some devices, read under their locks. Reservations of
    other live processes are visible; this process's earlier ones (a second
    plan) and dead processes' are already dropped."""

    def __init__(self, directory: Path, entries: dict[str, list[Reservation]], shared: bool = False) -> None:
        self.directory = directory
        self._entries = entries
        self.shared = shared
        """A shared ledger: files are written for the directory's group."""

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
        path = ledger_path(self.directory, device)
        try:
            write_atomically(path, json.dumps([asdict(e) for e in entries], indent=1), self.shared)
        except OSError as exc:
            raise LedgerError(f"cannot write the kv-budget ledger {path}: {exc.strerror or exc}") from exc
        self._entries[device] = entries[:-1]
        return mine


def _entry_problem(item: object, device: str) -> str | None:
    """Why ``item`` is not an entry an engine writes for ``device``; None where it is."""
    if not isinstance(item, dict) or set(item) != set(Reservation.__dataclass_fields__):
        return "not an entry of the ledger's fields"
    if item["device"] != device:
        return f"for another device ({str(item['device'])[:64]!r})"
    checks = {
        "pid": type(item["pid"]) is int and item["pid"] > 0,
        "process_start": isinstance(item["process_start"], (int, float)) and math.isfinite(item["process_start"]),
        "engine": isinstance(item["engine"], str) and len(item["engine"]) <= 1024,
        "reserved_bytes": type(item["reserved_bytes"]) is int and 0 <= item["reserved_bytes"] <= MAX_RESERVED_BYTES,
        "recorded_at": isinstance(item["recorded_at"], (int, float)) and math.isfinite(item["recorded_at"]),
    }
    bad = [name for name, ok in checks.items() if not ok]
    return f"{bad[0]}={repr(item[bad[0]])[:64]} is not what an engine records" if bad else None


def _valid_entries(raw: list, path: Path, device: str) -> list[Reservation]:
    """The entries an engine could have written, one per process (its
    latest); the rest dropped with one warning naming the file."""
    kept: dict[tuple[int, float], Reservation] = {}
    dropped: list[str] = []
    for item in raw:
        problem = _entry_problem(item, device)
        if problem is not None:
            dropped.append(problem)
            continue
        entry = Reservation(**item)
        key = (entry.pid, entry.process_start)
        if key in kept:
            dropped.append(f"a second entry of pid {entry.pid}")
        if key not in kept or entry.recorded_at >= kept[key].recorded_at:
            kept[key] = entry
    if dropped:
        logger.warning("the device ledger %s: %d entr%s dropped (first: %s); they reserve nothing", path,
                       len(dropped), "y" if len(dropped) == 1 else "ies", dropped[0])
    return list(kept.values())


_NAMED_PROCESS = re.compile(r'"pid"\s*:\s*(\d+)\s*,\s*"process_start"\s*:\s*([0-9.eE+-]+)')


def _set_aside_unless_live(path: Path, device: str, text: str, why: str) -> list[Reservation]:
    """A ledger file that cannot be read as one: refused in one line while a
    process it names still runs (its reservation would be lost), else moved
    aside (``.corrupt-<time>``) with one warning, so it stops no engine."""
    named = {(int(pid), float(start)) for pid, start in _NAMED_PROCESS.findall(text[:1 << 20])
             if _is_number(start)}
    live = sorted(pid for pid, start in named if process_alive(pid, start))
    if live:
        raise LedgerError(
            f"the kv-budget ledger {path} cannot be read ({why}) and names running process(es) "
            f"{', '.join(map(str, live))}; stop them, or remove the file once no engine runs on {device}")
    aside = path.with_name(f"{path.name}.corrupt-{time.time_ns()}")
    try:
        os.replace(path, aside)
    except OSError as exc:
        raise LedgerError(f"the kv-budget ledger {path} cannot be read ({why}) nor moved aside "
                          f"({exc.strerror or exc}); remove it") from exc
    logger.warning("the device ledger %s could not be read (%s) and names no running process: moved to %s; "
                   "%s is planned as if no other engine held it", path, why, aside.name, device)
    return []


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def _read(path: Path, device: str, shared: bool) -> list[Reservation]:
    """Live entries of other processes. A file kv-budget may not open (a
    link, a directory, another user's) is refused in one line naming it;
    one that does not parse, see :func:`_set_aside_unless_live`."""
    try:
        text = read_text(path, shared)
    except UnicodeDecodeError:
        return _set_aside_unless_live(path, device, read_head(path, 1 << 20, shared), "not UTF-8")
    except OSError as exc:
        if exc.errno == errno.EFBIG:
            return _set_aside_unless_live(path, device, read_head(path, 1 << 20, shared), str(exc.strerror))
        raise LedgerError(f"the kv-budget ledger {path} cannot be used ({exc.strerror or exc}); "
                          f"remove it once no engine runs on {device}, or {CHOOSE_ANOTHER}") from None
    if text is None:
        return []
    try:
        raw = json.loads(text or "[]")
    except ValueError as exc:
        return _set_aside_unless_live(path, device, text, f"not JSON: {exc}")
    if not isinstance(raw, list) or len(raw) > MAX_ENTRIES:
        why = "not a list of entries" if not isinstance(raw, list) else f"{len(raw):,} entries, over {MAX_ENTRIES:,}"
        return _set_aside_unless_live(path, device, text, why)
    me = os.getpid()
    return [e for e in _valid_entries(raw, path, device) if e.pid != me and process_alive(e.pid, e.process_start)]


@contextlib.contextmanager
def open_ledger(directory: Path, devices: list[str], shared: bool = False) -> Iterator[LedgerSession]:
    """Lock the ledgers of ``devices`` (sorted, so concurrent engines cannot
    deadlock), read them, and keep them locked until the block ends: plan
    and :meth:`LedgerSession.record` inside it. ``shared``: the directory is
    an operator's for a group (:mod:`kv_budget.runtime_files`)."""
    try:
        checked_dir(directory, CHOOSE_ANOTHER, shared)
    except UnsafeRuntimeDirError as exc:
        raise LedgerError(str(exc)) from None
    with contextlib.ExitStack() as stack:
        entries: dict[str, list[Reservation]] = {}
        for device in sorted(set(devices)):
            path = ledger_path(directory, device)
            lock = path.with_suffix(".lock")
            try:
                stack.enter_context(exclusive_lock(lock, shared))
            except OSError as exc:
                raise LedgerError(f"cannot lock the kv-budget ledger {lock} ({exc.strerror or exc}); "
                                  f"remove it once no engine runs on {device}, or {CHOOSE_ANOTHER}") from None
            remove_stale_temporaries(path)
            entries[device] = _read(path, device, shared)
        yield LedgerSession(directory, entries, shared)
