"""Fixtures for the reliability suite: the tiny pipeline of tests/diffusion, one trained run.

Runs use ``model.path`` = the shared tiny pipeline (no per-run model build) and
``never_load_the_model`` proves an error came before any model loaded.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from diffusion.conftest import tiny_pipeline_dir  # noqa: F401  (shared session fixture)

from mogradient_diffusion.cli import main


def train_arguments(run_dir: Path, model_dir: Path, *overrides: str) -> list[str]:
    """``train --preset tiny`` on ``model_dir``, quiet, 2 epochs unless overridden."""
    return [
        "train",
        "--preset",
        "tiny",
        f"run.directory={run_dir}",
        f"model.path={model_dir}",
        "run.quiet=true",
        "train.epochs=2",
        *overrides,
    ]


@pytest.fixture(scope="session")
def trained_run(tiny_pipeline_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    """A finished 2-epoch run with both checkpoints kept. Read-only: copy it to change it."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    arguments = train_arguments(run_dir, tiny_pipeline_dir, "run.keep_checkpoints=2")
    assert main(arguments) == 0
    return run_dir


@pytest.fixture
def run_copy(trained_run: Path, tmp_path: Path) -> Path:
    """A private copy of ``trained_run``."""
    return Path(shutil.copytree(trained_run, tmp_path / "run"))


@pytest.fixture
def never_load_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make loading the pipeline fail the test: the error must have come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("the pipeline was loaded before the error was reported")

    monkeypatch.setattr("mogradient_diffusion.training.trainer.Policy.load", refuse)
    monkeypatch.setattr("mogradient_diffusion.model.tiny.save_tiny_pipeline", refuse)
