"""Where benchmarks, probes and experiments plug into the training loop.

The trainer calls each hook at a fixed point of an epoch and of an optimizer step, so
code that times the loop or measures gradients subclasses ``TrainerCallback`` instead of
patching the trainer's methods. Every hook does nothing by default.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from mogradient_diffusion.objectives.base import TrainPiece
    from mogradient_diffusion.trainer import Trainer


class TrainerCallback:
    """Hooks of one run; override the ones you need."""

    def on_train_start(self, trainer: Trainer) -> None:
        """Everything is built and restored; the first epoch is next."""

    def on_epoch_start(self, trainer: Trainer) -> None:
        """Epoch ``trainer.epoch`` is about to sample."""

    def on_epoch_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        """Epoch ``trainer.epoch`` ended with ``record`` (what metrics.jsonl gets)."""

    def on_step_start(self, trainer: Trainer, step: list[TrainPiece]) -> None:
        """An optimizer step on ``step`` begins."""

    def replace_step(
        self, trainer: Trainer, step: list[TrainPiece], generator: torch.Generator
    ) -> dict[str, Any] | None:
        """Return a step record to take the optimizer step's place (nothing is applied),
        or None to let it run. ``step`` has its silent objectives masked (NaN)."""
        return None

    def on_step_end(self, trainer: Trainer, step: list[TrainPiece], record: dict[str, Any]) -> None:
        """The optimizer step on ``step`` ended with ``record``."""
