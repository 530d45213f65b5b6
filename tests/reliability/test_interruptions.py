"""A run that stops (Ctrl-C, a full disk, diverged weights) says so in one line, names
what it hit, and keeps the last checkpoint intact and resumable."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from mogradient_diffusion.cli import main
from mogradient_diffusion.runs import checkpoint
from mogradient_diffusion.runs.checkpoint import latest_checkpoint
from mogradient_diffusion.runs.metrics_log import read_metrics
from mogradient_diffusion.training.trainer import Trainer

from .conftest import train_arguments

FULL = OSError(errno.ENOSPC, "No space left on device")


def _last_line(text: str) -> str:
    assert "Traceback" not in text
    return text.strip().splitlines()[-1]


def _on_call(number: int, error: BaseException, original):
    """``original``, except that call ``number`` (1-based) raises ``error``."""
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(None)
        if len(calls) == number:
            raise error
        return original(*args, **kwargs)

    return wrapped


def _resumes(run_dir: Path, model_dir: Path) -> None:
    assert main(train_arguments(run_dir, model_dir, "train.epochs=3")) == 0
    assert [record["step"] for record in read_metrics(run_dir)] == [0, 1, 2]


def test_ctrl_c_is_one_line_saying_how_to_resume(
    tmp_path: Path, tiny_pipeline_dir: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    interrupted = _on_call(2, KeyboardInterrupt(), Trainer.train_epoch)
    monkeypatch.setattr(Trainer, "train_epoch", interrupted)
    assert main(train_arguments(tmp_path, tiny_pipeline_dir, "train.epochs=3")) == 130
    line = _last_line(capsys.readouterr().err)
    assert line.startswith("mogradient-diffusion: interrupted; the last checkpoint")
    assert "step_00000001" in line and "the same command resumes" in line
    monkeypatch.undo()
    _resumes(tmp_path, tiny_pipeline_dir)


def test_a_full_disk_while_logging_names_the_file_and_the_intact_checkpoint(
    tmp_path: Path, tiny_pipeline_dir: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = Path.open

    def open_or_fail(self: Path, mode: str = "r", *args, **kwargs):
        if self.name == "metrics.jsonl" and mode == "a" and latest_checkpoint(self.parent):
            raise FULL
        return original(self, mode, *args, **kwargs)

    monkeypatch.setattr(Path, "open", open_or_fail)
    assert main(train_arguments(tmp_path, tiny_pipeline_dir, "train.epochs=3")) == 1
    line = _last_line(capsys.readouterr().err)
    assert f"No space left on device ({tmp_path / 'metrics.jsonl'})" in line
    assert "step_00000001, is intact" in line
    monkeypatch.undo()
    _resumes(tmp_path, tiny_pipeline_dir)


def test_a_full_disk_while_checkpointing_keeps_the_previous_checkpoint(
    tmp_path: Path, tiny_pipeline_dir: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(checkpoint.torch, "save", _on_call(2, FULL, checkpoint.torch.save))
    assert main(train_arguments(tmp_path, tiny_pipeline_dir, "train.epochs=3")) == 1
    line = _last_line(capsys.readouterr().err)
    assert "No space left on device" in line and "step_00000002)" in line
    assert "step_00000001, is intact" in line
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000001"]
    monkeypatch.undo()
    _resumes(tmp_path, tiny_pipeline_dir)


def test_diverged_but_finite_weights_are_never_checkpointed(
    tmp_path: Path, tiny_pipeline_dir: Path, capsys
) -> None:
    arguments = train_arguments(tmp_path, tiny_pipeline_dir, "train.learning_rate=1e30")
    assert main(arguments) == 1
    line = _last_line(capsys.readouterr().err)
    assert line.startswith("mogradient-diffusion: training stopped:") and "diverged" in line
    assert "reward" not in line and latest_checkpoint(tmp_path) is None
