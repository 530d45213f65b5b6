"""The trainer's seams: callbacks see every epoch and optimizer step in order, with the
records metrics.jsonl gets, and a callback can take a step's place without patching."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mogradient_diffusion.runs.metrics_log import read_metrics
from mogradient_diffusion.training.distributed import World
from mogradient_diffusion.training.records import skipped_step_record
from mogradient_diffusion.training.trainer import Trainer, TrainerCallback
from mogradient_diffusion.training_config import load_config


class Recorder(TrainerCallback):
    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def on_train_start(self, trainer: Trainer) -> None:
        self.events.append(("train",))

    def on_epoch_start(self, trainer: Trainer) -> None:
        self.events.append(("epoch", trainer.epoch))

    def on_epoch_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        self.events.append(("epoch end", trainer.epoch, len(record["optimizer_steps"])))

    def on_step_start(self, trainer: Trainer, step: list) -> None:
        self.events.append(("step", sum(len(piece) for piece in step)))

    def on_step_end(self, trainer: Trainer, step: list, record: dict[str, Any]) -> None:
        self.events.append(("step end", record["weights"]))


class Measuring(TrainerCallback):
    """Takes every step's place, as a gradient measurement would: nothing is applied."""

    def replace_step(self, trainer: Trainer, step: list, generator: torch.Generator):
        return skipped_step_record("measured", step[0].advantages.shape[-1])


def _trainer(run_dir: Path, model_dir: Path, callback: TrainerCallback) -> Trainer:
    overrides = [f"run.directory={run_dir}", f"model.path={model_dir}", "run.quiet=true"]
    config = load_config(preset="tiny", overrides=[*overrides, "train.epochs=2"])
    return Trainer(config, World(rank=0, size=1, device=torch.device("cpu")), callbacks=[callback])


def test_callbacks_see_each_epoch_and_step_in_order(
    tmp_path: Path, tiny_pipeline_dir: Path
) -> None:
    recorder = Recorder()
    _trainer(tmp_path, tiny_pipeline_dir, recorder).run()
    records = read_metrics(tmp_path)
    expected: list[tuple[Any, ...]] = [("train",)]
    for epoch, record in enumerate(records):
        expected.append(("epoch", epoch))
        for step in record["optimizer_steps"]:
            expected += [("step", 4), ("step end", step["weights"])]
        expected.append(("epoch end", epoch, len(record["optimizer_steps"])))
    assert recorder.events == expected and len(records) == 2


def test_a_callback_can_take_a_steps_place(tmp_path: Path, tiny_pipeline_dir: Path) -> None:
    trainer = _trainer(tmp_path, tiny_pipeline_dir, Measuring())
    before = [p.detach().clone() for p in trainer.parameters]
    trainer.run()
    steps = [s for record in read_metrics(tmp_path) for s in record["optimizer_steps"]]
    assert steps and all(s["skipped"] == "measured" for s in steps)
    assert trainer.optimizer_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.parameters, strict=True))
