"""One trainer per run directory: an exclusive lock that names its holder.

Two trainers on one directory interleave their metrics and resume from each other's
checkpoints with their own settings. The lock is ``flock`` on the run directory itself,
held for the trainer's lifetime: deleting ``run_dir/train.lock`` (a common habit with
stale lock files) must not let a second trainer in, and a new file would be a new lock,
while a directory cannot be replaced under a running trainer. ``train.lock`` is locked
too (so trainers that lock only the file still exclude each other) and holds
``{"pid", "host"}`` so a refused trainer can say who has it. The kernel releases
``flock`` when its holder dies (even on SIGKILL), so a lock file left by a dead process
is simply taken over.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
from pathlib import Path
from typing import IO, Any

LOCK_FILE = "train.lock"
# Errors of a file system that cannot flock a directory (NFS emulates flock with POSIX
# locks, which want a writable descriptor): there the file lock alone holds the run.
_NO_DIRECTORY_LOCK = frozenset({errno.EBADF, errno.EINVAL, errno.ENOLCK, errno.EOPNOTSUPP})
_REOPENS = 8  # attempts when the lock file is replaced between opening and locking it


class RunDirectoryLocked(RuntimeError):
    """Another live trainer holds the run directory: a user error (exit 2), not a config one."""


class RunLock:
    """``with RunLock(run_dir) as lock:`` holds the directory; ``lock.previous`` is the
    holder recorded by a dead process whose lock was taken over (None if there was none)."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self.previous: dict[str, Any] | None = None
        self._directory_fd: int | None = None
        self._handle: IO[str] | None = None

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._directory_fd = _lock_directory(self.path.parent)
        except BlockingIOError:
            self._refuse(_recorded_holder(self.path))
        try:
            handle = self._lock_file()
        except RunDirectoryLocked:
            self._close_directory()
            raise
        self.previous = _read_holder(handle)
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
        handle.flush()
        self._handle = handle
        return self

    def _lock_file(self) -> IO[str]:
        """``train.lock`` open and locked, re-opened if it was replaced before the lock took."""
        for _ in range(_REOPENS):
            handle = open(self.path, "a+")  # noqa: SIM115 - held open until release()
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(handle)
                handle.close()
                self._refuse(holder)
            if _names(self.path, handle):
                return handle
            handle.close()  # deleted or replaced meanwhile: that lock guards nothing
        raise RunDirectoryLocked(
            f"lock file {self.path} keeps being replaced; is another trainer starting there?"
        )

    def _refuse(self, holder: dict[str, Any] | None) -> None:
        raise RunDirectoryLocked(
            f"run directory {self.path.parent} is in use by {describe_holder(holder)} (lock "
            f"file {self.path}); wait for it to finish or choose another run.directory"
        )

    def _close_directory(self) -> None:
        if self._directory_fd is not None:
            os.close(self._directory_fd)  # closing drops the flock
            self._directory_fd = None

    def release(self) -> None:
        if self._handle is not None:
            self._handle.seek(0)
            self._handle.truncate()
            self._handle.close()  # closing drops the flock
            self._handle = None
        self._close_directory()

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _lock_directory(directory: Path) -> int | None:
    """A descriptor of ``directory`` holding its exclusive flock; None where the file system
    cannot lock a directory. Raises BlockingIOError while another process holds it."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise
    except OSError as error:
        os.close(fd)
        if error.errno in _NO_DIRECTORY_LOCK:
            return None
        raise
    return fd


def _names(path: Path, handle: IO[str]) -> bool:
    """Whether ``path`` still names the file open as ``handle`` (not deleted or replaced)."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(handle.fileno())
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def _recorded_holder(path: Path) -> dict[str, Any] | None:
    """The holder ``path`` records, without creating it (the user may have deleted it)."""
    try:
        with open(path) as handle:
            return _read_holder(handle)
    except FileNotFoundError:
        return None


def _read_holder(handle: IO[str]) -> dict[str, Any] | None:
    handle.seek(0)
    try:
        holder = json.loads(handle.read())
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


def describe_holder(holder: dict[str, Any] | None) -> str:
    """``pid N on host H`` for a lock file's record."""
    if holder is None:
        return "another trainer"
    return f"pid {holder.get('pid')} on host {holder.get('host')}"
