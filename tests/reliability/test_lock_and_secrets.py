"""Two probe findings: deleting ``train.lock`` must not let a second trainer in, and the
UnifiedReward API key must never reach the disk (config.yaml, checkpoints, summaries)."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

import pytest

# server: the fake judge on 127.0.0.1; _no_proxy_or_key (autouse here too): loopback goes
# direct and no ambient key is set.
from diffusion.test_unified_reward import (  # noqa: F401
    FakeVlmServer,
    _no_proxy_or_key,
    server,
    solid_images,
)

from mogradient_diffusion.cli import main
from mogradient_diffusion.rewards.registry import make_reward
from mogradient_diffusion.rewards.unified_reward import API_KEY_ENV, UnifiedReward
from mogradient_diffusion.runs import lock as lock_module
from mogradient_diffusion.runs.lock import LOCK_FILE, RunDirectoryLocked, RunLock

from .conftest import train_arguments
from .test_run_lock import _holder

SECRET = "sk-do-not-write-me-0123456789"
IN_USE = "is in use by"


def test_deleting_the_lock_file_does_not_let_a_second_trainer_in(tmp_path: Path) -> None:
    holder = _holder(tmp_path)
    try:
        (tmp_path / LOCK_FILE).unlink()
        with pytest.raises(RunDirectoryLocked, match=IN_USE) as info:
            RunLock(tmp_path).acquire()
        assert "wait for it to finish or choose another run.directory" in str(info.value)
        assert not (tmp_path / LOCK_FILE).exists()  # the refused one created nothing
    finally:
        holder.kill()
        holder.wait()
    with RunLock(tmp_path):  # the holder is gone: the run is free again
        assert (tmp_path / LOCK_FILE).exists()


def test_a_trainer_is_refused_after_the_lock_file_was_deleted(
    tmp_path: Path, tiny_pipeline_dir: Path, capsys, never_load_the_model
) -> None:
    holder = _holder(tmp_path)
    try:
        (tmp_path / LOCK_FILE).unlink()
        assert main(train_arguments(tmp_path, tiny_pipeline_dir)) == 2
    finally:
        holder.kill()
        holder.wait()
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and IN_USE in error and "Traceback" not in error


def test_two_locks_in_one_process_exclude_each_other_after_deletion(tmp_path: Path) -> None:
    with RunLock(tmp_path):
        (tmp_path / LOCK_FILE).unlink()
        with pytest.raises(RunDirectoryLocked, match=IN_USE):
            RunLock(tmp_path).acquire()
    with RunLock(tmp_path) as lock:  # released cleanly, the file re-created
        assert lock.previous is None


def test_without_directory_locks_the_file_lock_still_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file system that cannot flock a directory (NFS) falls back to the file lock."""
    real_flock = fcntl.flock

    def no_directory_flock(target, operation):
        if isinstance(target, int):  # the directory's descriptor
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        return real_flock(target, operation)

    monkeypatch.setattr(lock_module.fcntl, "flock", no_directory_flock)
    refused = pytest.raises(RunDirectoryLocked, match=f"pid {os.getpid()} on host")
    with RunLock(tmp_path), refused:
        RunLock(tmp_path).acquire()
    with RunLock(tmp_path) as lock:
        assert lock.previous is None


def test_a_literal_api_key_is_refused_naming_the_variable() -> None:
    with pytest.raises(ValueError, match=f"environment variable {API_KEY_ENV}") as info:
        make_reward("unified_reward", base_url="http://127.0.0.1:1/v1", api_key=SECRET)
    assert "\n" not in str(info.value) and SECRET not in str(info.value)


def test_the_key_comes_from_the_environment_and_is_not_kept(
    server: FakeVlmServer,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MY_JUDGE_KEY", SECRET)
    reward = UnifiedReward(base_url=server.base_url, api_key_env="MY_JUDGE_KEY", backoff=0.0)
    reward(solid_images([0]), ["a cube score=3"])
    [request] = server.requests
    assert request.headers["Authorization"] == f"Bearer {SECRET}"
    assert SECRET not in repr(reward) and SECRET not in repr(vars(reward))


def test_train_refuses_a_key_in_the_config_before_writing_anything(
    tmp_path: Path, tiny_pipeline_dir: Path, capsys, never_load_the_model
) -> None:
    options = f"{{base_url: 'http://127.0.0.1:1/v1', api_key: {SECRET}}}"
    reward = f"{{name: unified_reward, options: {options}}}"
    run_dir = tmp_path / "run"
    arguments = train_arguments(run_dir, tiny_pipeline_dir, f"rewards=[{reward}]")
    assert main(arguments) == 2
    out, err = capsys.readouterr()
    assert API_KEY_ENV in err and SECRET not in out + err
    written = [path for path in run_dir.rglob("*") if path.is_file()]
    assert all(SECRET.encode() not in path.read_bytes() for path in written)
    assert not (run_dir / "config.yaml").exists()
