"""Writing and locking files in kv-budget's runtime directory: one way for all.

The device ledger, the vLLM-Omni deployment record and the engines' status
files are read by other processes while they are written. Each is written
whole to a temporary file beside it and renamed over it (a reader sees the
old file or the new one, never half of either), and read-modify-write
sequences hold an exclusive ``flock`` on a ``.lock`` file of their own (the
data file is replaced, so it cannot carry the lock). OSError goes to the
caller, whose error names what the file is for.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["write_atomically", "exclusive_lock"]


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file of this process beside it, then rename."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(text)
    temporary.replace(path)


@contextlib.contextmanager
def exclusive_lock(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (created if missing) for the block."""
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
