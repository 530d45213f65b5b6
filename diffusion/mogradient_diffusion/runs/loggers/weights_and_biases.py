"""Weights & Biases: offline by default (``<run>/wandb/``; ``wandb sync`` uploads it later),
or online. Epoch scalars are charted against ``epoch``, the steps' diagnostics against
``optimizer_step`` (W&B's own step only counts ``log`` calls)."""

from __future__ import annotations

from typing import Any

from mogradient_diffusion.runs import metric_keys as keys
from mogradient_diffusion.runs.loggers.base import (
    EpochLog,
    Logger,
    LogTarget,
    epoch_scalars,
    remember_id,
    remembered_id,
)

EPOCH_AXIS = "epoch"
STEP_AXIS = "optimizer_step"


class WandbLogger(Logger):
    name = "wandb"
    requires = "wandb"
    install = "pip install 'mogradient-diffusion[wandb]'"

    def __init__(self, target: LogTarget) -> None:
        import wandb

        super().__init__(target)
        self._wandb = wandb
        self._run = wandb.init(
            project=target.settings.wandb_project,
            mode=target.settings.wandb_mode,
            dir=str(target.directory),
            id=remembered_id(target, self.name),  # a resumed run continues its W&B run
            resume="allow",
            name=target.directory.name,
            config=target.config,
            reinit="create_new",
            settings=wandb.Settings(silent=True, console="off"),
        )
        remember_id(target, self.name, self._run.id)
        self._run.define_metric(EPOCH_AXIS)
        self._run.define_metric(STEP_AXIS)
        self._axis: dict[str, str] = {}

    def log(self, epoch: EpochLog) -> None:
        for step, scalars in epoch.steps():
            self._log(STEP_AXIS, step, scalars)
        payload: dict[str, Any] = dict(epoch_scalars(epoch.record))
        if epoch.samples is not None:
            payload[keys.SAMPLES] = self._wandb.Image(epoch.samples)
        self._log(EPOCH_AXIS, epoch.epoch, payload)

    def _log(self, axis: str, index: int, payload: dict[str, Any]) -> None:
        for key in payload:
            if key not in self._axis:
                self._run.define_metric(key, step_metric=axis)
                self._axis[key] = axis
        self._run.log({axis: index, **payload})

    def close(self) -> None:
        self._run.finish()
