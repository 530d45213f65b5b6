"""Where a run's records go, chosen by name in ``run.loggers``: metrics.jsonl (always),
TensorBoard, Weights & Biases, MLflow.

Each logger is a small class behind one interface (``Logger``: an epoch in, close),
registered in ``LOGGERS`` like every other extension point, so a user module (listed in
``reward_modules``) can add one with ``@LOGGERS.register()``. The built-in entries are
lazy: W&B and MLflow load only when chosen.
"""

from __future__ import annotations

from mogradient.registry import Registry
from mogradient_diffusion.runs.loggers.base import (
    EpochLog,
    Logger,
    LogTarget,
    epoch_scalars,
    step_scalars,
)

LOGGERS: Registry[type[Logger]] = Registry("logger")
LOGGERS.add("jsonl", "mogradient_diffusion.runs.loggers.jsonl:JsonlLogger")
LOGGERS.add("tensorboard", "mogradient_diffusion.runs.loggers.tensorboard:TensorBoardLogger")
LOGGERS.add("wandb", "mogradient_diffusion.runs.loggers.weights_and_biases:WandbLogger")
LOGGERS.add("mlflow", "mogradient_diffusion.runs.loggers.mlflow_tracking:MlflowLogger")

__all__ = ["LOGGERS", "EpochLog", "LogTarget", "Logger", "epoch_scalars", "step_scalars"]
