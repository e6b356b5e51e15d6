"""kv-budget's runtime directory: checked before use, its files opened one safe way.

The device ledger, the vLLM-Omni deployment record and the engines' status
files live in a directory that, by default, sits in ``/tmp`` where any local
user can create a name first. So the directory is checked, not trusted
(:func:`checked_dir`), and every file in it is opened without following
symbolic links and refused unless it is a regular file of an accepted owner:
another user cannot plant a link that makes an engine write where they chose,
nor a directory or FIFO that makes it hang or crash.

Two kinds of directory:

* **private** (the default): owned by the engine's user and writable by no
  one else; created with mode 0700 where missing. Files are created 0600.
* **shared** (opt-in, ``--model-local-kv-ledger-shared on``): a directory the
  operator made for a group, so engines of several users on one GPU plan
  against one ledger. It must exist, be set-group-ID (files created in it
  take its group), writable by no one outside its group, and this process
  must be in that group. Files are created 0660 and may be owned by any
  member of the group.

Files are written whole to a temporary beside them and renamed over them (a
reader sees the old file or the new one, never half of either); read-modify-
write sequences hold an exclusive ``flock`` on a ``.lock`` file of their own
(the data file is replaced, so it cannot carry the lock). A process killed
mid-write leaves only its temporary, which :func:`remove_stale_temporaries`
clears under the lock; a process killed holding the lock releases it with
its file descriptors.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import grp
import os
import pwd
import stat
from collections.abc import Iterator
from pathlib import Path

from kv_budget.errors import KvBudgetError

__all__ = [
    "MAX_FILE_BYTES",
    "UnsafeRuntimeDirError",
    "UnsafeRuntimeFileError",
    "checked_dir",
    "read_text",
    "read_head",
    "write_atomically",
    "exclusive_lock",
    "remove_stale_temporaries",
]

MAX_FILE_BYTES = 4 * 1024 * 1024
"""The most :func:`read_text` reads: a ledger of every engine a host could
run is a few kilobytes; a file larger than this is not one kv-budget wrote."""


class UnsafeRuntimeDirError(KvBudgetError, RuntimeError):
    """The runtime directory is not what kv-budget may trust; the message
    names the path, its owner and mode, and how to choose another."""


class UnsafeRuntimeFileError(KvBudgetError, OSError):
    """A file in the runtime directory is a link, not a regular file, of an
    owner outside the accepted ones, or too large. An ``OSError`` whose
    ``filename`` is the file and ``strerror`` what is wrong with it, so a
    caller's handler for unreadable files names it with its purpose."""


def _owner(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _group(gid: int) -> str:
    try:
        return f"{grp.getgrgid(gid).gr_name} (gid {gid})"
    except KeyError:
        return f"gid {gid}"


def _ownership(info: os.stat_result) -> str:
    return f"owner {_owner(info.st_uid)}, group {_group(info.st_gid)}, mode {stat.filemode(info.st_mode)}"


def _dir_problem(info: os.stat_result, shared: bool) -> str | None:
    """Why a directory of this status cannot be trusted; None where it can."""
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    if not shared:
        if info.st_uid != os.geteuid():
            return "is owned by another user"
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return "is writable by group or others"
        return None
    if info.st_mode & stat.S_IWOTH:
        return "is writable by users outside its group"
    if not info.st_mode & stat.S_ISGID:
        return "is not set-group-ID (files created in it would not take its group)"
    if info.st_gid != os.getegid() and info.st_gid not in os.getgroups():
        return "belongs to a group this process is not in"
    return None


def checked_dir(path: Path, fix: str, shared: bool = False) -> Path:
    """``path``, created private (0700) where missing and ``shared`` is off,
    after checking it is what the module docstring says; else
    :class:`UnsafeRuntimeDirError` naming it, its owner and mode, and
    ``fix`` (how the operator chooses another)."""
    if not shared:
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=0o700, parents=True)
    try:
        info = os.lstat(path)
    except OSError as exc:
        made = "" if not shared else "; create it for the group: install -d -m 2770 -g GROUP DIR"
        raise UnsafeRuntimeDirError(
            f"kv-budget's runtime directory {path} cannot be used ({exc.strerror or exc}){made}; {fix}") from None
    problem = _dir_problem(info, shared)
    if problem is not None:
        kind = "shared" if shared else "private"
        raise UnsafeRuntimeDirError(
            f"kv-budget's {kind} runtime directory {path} ({_ownership(info)}) {problem}; {fix}")
    return path


def _file_problem(info: os.stat_result, shared: bool) -> str | None:
    if not stat.S_ISREG(info.st_mode):
        return "is a directory, not a file" if stat.S_ISDIR(info.st_mode) else "is not a regular file"
    if not shared and info.st_uid != os.geteuid():
        return "is owned by another user"
    if info.st_mode & stat.S_IWOTH or (not shared and info.st_mode & stat.S_IWGRP):
        return "is writable by others"
    return None


def _open(path: Path, flags: int, shared: bool) -> int:
    """A descriptor of ``path`` opened without following a link, checked
    (:func:`_file_problem`); the file is created with the directory kind's
    mode where ``flags`` ask for it."""
    mode = 0o660 if shared else 0o600
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeRuntimeFileError(errno.ELOOP, "a symbolic link, not followed", str(path)) from None
        raise
    try:
        info = os.fstat(fd)
        problem = _file_problem(info, shared)
        if problem is not None:
            raise UnsafeRuntimeFileError(errno.EPERM, f"{_ownership(info)}: {problem}", str(path))
        if shared and flags & os.O_CREAT and info.st_uid == os.geteuid():
            os.fchmod(fd, mode)  # the umask may have taken the group's bits
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_text(path: Path, shared: bool = False, limit: int = MAX_FILE_BYTES) -> str | None:
    """The text of ``path``; None where it does not exist. Raises
    :class:`UnsafeRuntimeFileError` for a link, a non-regular file, a foreign
    owner or more than ``limit`` bytes, ``UnicodeDecodeError`` for bytes that
    are not UTF-8."""
    try:
        fd = _open(path, os.O_RDONLY, shared)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise UnsafeRuntimeFileError(errno.EFBIG, f"larger than {limit:,} B", str(path))
    return data.decode()


def read_head(path: Path, size: int, shared: bool = False) -> str:
    """The first ``size`` bytes of ``path`` as text (undecodable bytes
    replaced), opened as :func:`read_text` opens it: what a file too large
    to read whole says about itself."""
    with os.fdopen(_open(path, os.O_RDONLY, shared), "rb") as handle:
        return handle.read(size).decode(errors="replace")


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def write_atomically(path: Path, text: str, shared: bool = False) -> None:
    """Write ``text`` to ``path`` through a temporary of this process beside
    it (created exclusively, never through a link), then rename it over
    ``path`` (a rename replaces a link at ``path``, it does not follow it)."""
    temporary = _temporary(path)
    try:
        fd = _open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, shared)
    except FileExistsError:
        os.unlink(temporary)  # this pid's, left by a killed process that had it before
        fd = _open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, shared)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


@contextlib.contextmanager
def exclusive_lock(lock_path: Path, shared: bool = False) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (created if missing, never
    through a link) for the block."""
    fd = _open(lock_path, os.O_RDWR | os.O_CREAT, shared)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def remove_stale_temporaries(path: Path) -> list[Path]:
    """Remove the temporaries of ``path`` that writers left (call it holding
    the file's lock, under which no live writer has one open); return them."""
    removed = []
    for temporary in path.parent.glob(f".{path.name}.*.tmp"):
        with contextlib.suppress(OSError):
            if stat.S_ISREG(os.lstat(temporary).st_mode):
                os.unlink(temporary)
                removed.append(temporary)
    return removed
