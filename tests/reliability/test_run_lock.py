"""One trainer per run directory: a second one is refused naming the holder; the lock of
a dead process is taken over."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mogradient_diffusion.cli import main
from mogradient_diffusion.runs.lock import LOCK_FILE, RunDirectoryLocked, RunLock

from .conftest import train_arguments

HOLD = "import sys, time; from mogradient_diffusion.runs.lock import RunLock; "
HOLD += "lock = RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(600)"


def _holder(run_dir: Path) -> subprocess.Popen:
    """Another process holding ``run_dir``'s lock (it prints once it does)."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout.readline().strip() == "held"
    return process


def test_a_second_trainer_is_refused_in_one_line_naming_the_holder(
    tmp_path: Path, tiny_pipeline_dir: Path, capsys, never_load_the_model
) -> None:
    holder = _holder(tmp_path)
    try:
        assert main(train_arguments(tmp_path, tiny_pipeline_dir)) == 2
    finally:
        holder.kill()
        holder.wait()
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "Traceback" not in error
    assert f"pid {holder.pid} on host {socket.gethostname()}" in error


def test_the_lock_of_a_killed_process_is_taken_over(tmp_path: Path) -> None:
    holder = _holder(tmp_path)
    with pytest.raises(RunDirectoryLocked):
        RunLock(tmp_path).acquire()
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    with RunLock(tmp_path) as lock:  # the kernel released the dead holder's lock
        assert lock.previous == {"pid": holder.pid, "host": socket.gethostname()}
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    with RunLock(tmp_path) as lock:  # released cleanly: nothing to take over
        assert lock.previous is None


def test_a_lock_file_left_by_a_dead_process_does_not_block_training(
    tmp_path: Path, tiny_pipeline_dir: Path, capsys, never_load_the_model
) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    record = {"pid": dead.pid, "host": socket.gethostname(), "since": time.time()}
    (tmp_path / LOCK_FILE).write_text(json.dumps(record))
    with pytest.raises(AssertionError, match="pipeline was loaded"):  # it got past the lock
        main(train_arguments(tmp_path, tiny_pipeline_dir))
    assert f"taking over the lock left by pid {dead.pid}" in capsys.readouterr().out
