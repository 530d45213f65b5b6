"""TensorBoard: the epoch scalars and sample grids under ``tensorboard/``, the optimizer
steps' diagnostics under ``tensorboard/optimizer_steps/``.

Two writers because a resume purges by step: the epochs' writer purges from the resume
epoch, the steps' writer from the resume optimizer step; one writer would purge the
per-step series with an epoch index.
"""

from __future__ import annotations

from mogradient_diffusion.runs import metric_keys as keys
from mogradient_diffusion.runs.loggers.base import EpochLog, Logger, LogTarget, epoch_scalars


class TensorBoardLogger(Logger):
    name = "tensorboard"

    def __init__(self, target: LogTarget) -> None:
        from torch.utils.tensorboard import SummaryWriter

        super().__init__(target)
        root = target.directory / "tensorboard"
        self._epochs = SummaryWriter(str(root), purge_step=target.resume_epoch or None)
        self._steps = SummaryWriter(
            str(root / "optimizer_steps"), purge_step=target.resume_optimizer_step or None
        )

    def log(self, epoch: EpochLog) -> None:
        for key, value in epoch_scalars(epoch.record).items():
            self._epochs.add_scalar(key, value, epoch.epoch)
        if epoch.samples is not None:
            self._epochs.add_image(keys.SAMPLES, epoch.samples, epoch.epoch, dataformats="HWC")
        for step, scalars in epoch.steps():
            for key, value in scalars.items():
                self._steps.add_scalar(key, value, step)
        self._epochs.flush()
        self._steps.flush()

    def close(self) -> None:
        self._epochs.close()
        self._steps.close()
