"""No checkpoint is ever replaced by a fresh start: a damaged manifest is a damaged
checkpoint, passed over with a notice or refused, never a run with nothing saved."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from mogradient_diffusion.cli import main
from mogradient_diffusion.runs.checkpoint import (
    CorruptCheckpointError,
    load_newest_intact,
    save_checkpoint,
)
from mogradient_diffusion.runs.metrics_log import read_metrics

from .conftest import train_arguments


def _digests(run_dir: Path) -> dict[str, str]:
    return {
        str(path.relative_to(run_dir)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(run_dir.rglob("*"))
        if path.is_file() and "tensorboard" not in path.parts
    }


@pytest.mark.parametrize("damage", ["x", "{}", '{"step": 7}', "[1]"])
def test_a_damaged_manifest_is_a_damaged_checkpoint(tmp_path: Path, damage: str) -> None:
    for step in (1, 2):
        save_checkpoint(tmp_path, step, {"step": step, "weights": torch.ones(10) * step})
    (tmp_path / "checkpoints" / "step_00000002" / "manifest.json").write_text(damage)
    restored = load_newest_intact(tmp_path)
    assert restored.state["step"] == 1
    assert len(restored.passed_over) == 1 and "step_00000002" in restored.passed_over[0]
    (tmp_path / "checkpoints" / "step_00000001" / "manifest.json").write_text(damage)
    with pytest.raises(CorruptCheckpointError, match=r"no intact checkpoint.*new run\.directory"):
        load_newest_intact(tmp_path)


def test_a_run_whose_manifests_are_all_damaged_is_refused_and_left_as_it_was(
    run_copy: Path, tiny_pipeline_dir: Path, capsys
) -> None:
    for manifest in (run_copy / "checkpoints").glob("step_*/manifest.json"):
        manifest.write_text("x")
    before = _digests(run_copy)
    assert main(train_arguments(run_copy, tiny_pipeline_dir, "train.epochs=4")) == 1
    error = capsys.readouterr().err
    lines = [line for line in error.splitlines() if line.strip()]
    assert len(lines) == 1 and "no intact checkpoint" in lines[0], lines
    assert _digests(run_copy) == before


def test_a_damaged_latest_manifest_falls_back_with_a_notice(
    run_copy: Path, tiny_pipeline_dir: Path, capsys
) -> None:
    (run_copy / "checkpoints" / "step_00000002" / "manifest.json").write_text("x")
    assert main(train_arguments(run_copy, tiny_pipeline_dir, "train.epochs=3")) == 0
    error = capsys.readouterr().err
    assert "passed over: step_00000002" in error and "Traceback" not in error
    assert [record["step"] for record in read_metrics(run_copy)] == [0, 1, 2]
