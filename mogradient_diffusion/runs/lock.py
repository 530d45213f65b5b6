"""One trainer per run directory: an exclusive lock file that names its holder.

Two trainers on one directory interleave their metrics and resume from each other's
checkpoints with their own settings. The lock is ``run_dir/train.lock``, held with
``flock`` for the trainer's lifetime and holding ``{"pid", "host"}`` so a refused
trainer can say who has it. The kernel releases ``flock`` when its holder dies (even on
SIGKILL), so a lock file left by a dead process is simply taken over.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from pathlib import Path
from typing import Any

LOCK_FILE = "train.lock"


class RunDirectoryLocked(RuntimeError):
    """Another live trainer holds the run directory: a user error (exit 2), not a config one."""


class RunLock:
    """``with RunLock(run_dir) as lock:`` holds the directory; ``lock.previous`` is the
    holder recorded by a dead process whose lock was taken over (None if there was none)."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self.previous: dict[str, Any] | None = None
        self._handle = None

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.path, "a+")  # noqa: SIM115 - held open until release()
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = describe_holder(_read_holder(handle))
            handle.close()
            raise RunDirectoryLocked(
                f"run directory {self.path.parent} is in use by {holder} (lock file "
                f"{self.path}); wait for it to finish or choose another run.directory"
            ) from None
        self.previous = _read_holder(handle)
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
        handle.flush()
        self._handle = handle
        return self

    def release(self) -> None:
        if self._handle is None:
            return
        self._handle.seek(0)
        self._handle.truncate()
        self._handle.close()  # closing drops the flock
        self._handle = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_holder(handle) -> dict[str, Any] | None:
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
