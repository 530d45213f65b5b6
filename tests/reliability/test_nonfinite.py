"""No non-finite value is ever checkpointed: finite config floats, skipped non-finite
steps with a limit, and a fall-back past a damaged or poisoned latest checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mogradient_diffusion.cli import main
from mogradient_diffusion.runs.checkpoint import (
    CorruptCheckpointError,
    latest_checkpoint,
    load_checkpoint,
    load_newest_intact,
    save_checkpoint,
)
from mogradient_diffusion.runs.metrics_log import read_metrics
from mogradient_diffusion.training.distributed import World
from mogradient_diffusion.training.finite import NonFiniteError
from mogradient_diffusion.training.trainer import Trainer
from mogradient_diffusion.training_config import ConfigError, load_config

from .conftest import train_arguments


@pytest.mark.parametrize(
    "overrides",
    [
        ["train.learning_rate=.inf"],
        ["objective.beta=.nan"],
        ["train.adam_betas=[0.9, .nan]"],
        ["strategy.rho=-.inf"],
        ["strategy.name=weighted_sum", "strategy.weights=[1, .inf]"],
    ],
    ids=lambda overrides: overrides[-1],
)
def test_config_floats_must_be_finite(overrides: list[str]) -> None:
    with pytest.raises(ConfigError, match="finite"):
        load_config(preset="tiny", overrides=overrides)


class PoisonedWorld(World):
    """One process whose gradient average turns NaN on the chosen optimizer steps."""

    def __init__(self, poisoned_steps: set[int] | None) -> None:
        super().__init__(rank=0, size=1, device=torch.device("cpu"))
        self.poisoned_steps, self.calls = poisoned_steps, 0

    def average_gradients(self, parameters: list[torch.Tensor]) -> None:
        if self.poisoned_steps is None or self.calls in self.poisoned_steps:
            parameters[0].grad = torch.full_like(parameters[0], float("nan"))
        self.calls += 1


def _trainer(run_dir: Path, model_dir: Path, world: World, *overrides: str) -> Trainer:
    arguments = train_arguments(run_dir, model_dir, *overrides)
    return Trainer(load_config(preset="tiny", overrides=arguments[3:]), world)


def _finite(state: dict) -> bool:
    return all(bool(t.isfinite().all()) for t in state.values())


def test_a_step_with_non_finite_gradients_is_skipped_and_logged(
    tmp_path: Path, tiny_pipeline_dir: Path
) -> None:
    _trainer(tmp_path, tiny_pipeline_dir, PoisonedWorld({0}), "train.epochs=1").run()
    steps = read_metrics(tmp_path)[0]["optimizer_steps"]
    assert steps[0]["skipped"] == "non-finite gradients"
    assert "skipped" not in steps[1]
    state = load_checkpoint(latest_checkpoint(tmp_path), weights_only=False)
    assert _finite(state["default"]) and _finite(state["old"])


def test_non_finite_gradients_in_a_row_stop_the_run_after_the_limit(
    tmp_path: Path, tiny_pipeline_dir: Path
) -> None:
    limit = "train.max_nonfinite_steps=1"
    trainer = _trainer(tmp_path, tiny_pipeline_dir, PoisonedWorld(None), limit)
    with pytest.raises(NonFiniteError, match="2 optimizer steps in a row"):
        trainer.run()
    assert latest_checkpoint(tmp_path) is None


def test_weights_that_overflow_stop_the_run_in_one_line_before_they_are_saved(
    tmp_path: Path, tiny_pipeline_dir: Path, capsys
) -> None:
    # Finite settings whose first decoupled weight decay, p *= 1 - lr * wd, overflows.
    overrides = ["train.learning_rate=1e37", "train.weight_decay=1e3"]
    assert main(train_arguments(tmp_path, tiny_pipeline_dir, *overrides)) == 1
    error = capsys.readouterr().err
    last = error.strip().splitlines()[-1]
    assert "Traceback" not in error and last.startswith("mogradient-diffusion: training stopped")
    assert "non-finite" in last and "train.learning_rate" in last
    assert latest_checkpoint(tmp_path) is None


def _damage(path: Path, how: str) -> None:
    state = path / "state.pt"
    data = bytearray(state.read_bytes())
    if how == "truncated":
        state.write_bytes(data[: len(data) // 2])
    else:
        data[len(data) // 2] ^= 0x01
        state.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncated", "bit-flipped"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_newest_intact_one(
    tmp_path: Path, how: str
) -> None:
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, {"step": step, "weights": torch.ones(1000) * step})
    _damage(tmp_path / "checkpoints" / "step_00000003", how)
    restored = load_newest_intact(tmp_path)
    assert restored.state["step"] == 2
    assert restored.passed_over and "step_00000003" in restored.passed_over[0]
    _damage(tmp_path / "checkpoints" / "step_00000002", how)
    _damage(tmp_path / "checkpoints" / "step_00000001", how)
    with pytest.raises(CorruptCheckpointError, match="no intact checkpoint"):
        load_newest_intact(tmp_path)


def test_a_resume_passes_over_a_damaged_latest_checkpoint_with_a_notice(
    run_copy: Path, tiny_pipeline_dir: Path, capsys
) -> None:
    _damage(run_copy / "checkpoints" / "step_00000002", "bit-flipped")
    assert main(train_arguments(run_copy, tiny_pipeline_dir, "train.epochs=3")) == 0
    error = capsys.readouterr().err
    assert "passed over: step_00000002" in error and "Traceback" not in error
    assert [record["step"] for record in read_metrics(run_copy)] == [0, 1, 2]


def test_a_poisoned_checkpoint_is_never_resumed(run_copy: Path, tiny_pipeline_dir: Path) -> None:
    latest = latest_checkpoint(run_copy)
    state = load_checkpoint(latest, weights_only=False)
    next(iter(state["default"].values())).fill_(float("nan"))
    save_checkpoint(run_copy, 2, state)  # as an older version would have saved it
    trainer = _trainer(run_copy, tiny_pipeline_dir, PoisonedWorld(set()), "train.epochs=3")
    assert trainer._restored.path.name == "step_00000001"
    assert "non-finite" in trainer._restored.passed_over[0]


@pytest.mark.parametrize("scale", [1e38, 3e38])
def test_reward_means_near_the_float32_maximum_are_logged_finite(scale: float) -> None:
    """Float32 rewards near 3.4e38 overflowed a float32 mean to inf, logged as null."""
    from mogradient_diffusion.runs import metric_keys as keys
    from mogradient_diffusion.training.records import epoch_record

    rewards = torch.full((8, 1), scale, dtype=torch.float32)
    rewards[::2] *= 0.5
    record = epoch_record(["big"], ["big"], rewards, {}, {}, [False], [], {}, 0.0)
    expected = rewards.double()
    assert record[keys.reward_mean("big")] == pytest.approx(float(expected.mean()), rel=1e-12)
    assert record[keys.reward_std("big")] == pytest.approx(
        float(expected.std(unbiased=False)), rel=1e-12
    )
