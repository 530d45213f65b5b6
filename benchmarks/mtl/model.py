"""A tiny shared conv trunk with one linear head per task (~24k parameters for two tasks)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional

from benchmarks.mtl.data import Split, Task

FEATURES = 64


class MultiTaskNet(nn.Module):
    """Conv(1->16) pool Conv(16->32) pool Linear(288->64): the trunk every task shares.

    ``preference_size`` R > 0 makes it preference-conditioned, for COSMOS (Ruchte and
    Grabocka 2021), whose model takes the preference vector with its input: the R
    preference entries are appended to the image as R constant channels (the authors'
    code maps them to image-sized channels with a small learned transposed CNN; constant
    channels are the minimal form). The default R = 0 builds and runs exactly the
    unconditioned model every other method trains.
    """

    def __init__(self, tasks: tuple[Task, ...], preference_size: int = 0) -> None:
        super().__init__()
        self.preference_size = preference_size
        self.trunk = nn.Sequential(
            nn.Conv2d(1 + preference_size, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * 3 * 3, FEATURES),
            nn.ReLU(),
        )
        self.heads = nn.ModuleList(nn.Linear(FEATURES, task.outputs) for task in tasks)
        self.tasks = tasks

    def forward(
        self, images: torch.Tensor, preference: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The shared features (TorchJD's ``mtl_backward`` needs them) and each head's output.

        A preference-conditioned model needs ``preference`` (R entries, one for the batch).
        """
        given = 0 if preference is None else len(preference)
        if given != self.preference_size:
            raise ValueError(
                f"this model takes {self.preference_size} preference entries with its input, "
                f"got {given}"
            )
        if preference is not None:
            count, _, height, width = images.shape
            channels = preference.to(images).reshape(1, -1, 1, 1)
            images = torch.cat([images, channels.expand(count, -1, height, width)], dim=1)
        features = self.trunk(images)
        return features, [head(features) for head in self.heads]

    def shared_parameters(self) -> list[nn.Parameter]:
        return list(self.trunk.parameters())


def task_loss(task: Task, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if task.loss == "ce":
        return functional.cross_entropy(output, target)
    if task.loss == "bce":
        return functional.binary_cross_entropy_with_logits(output.squeeze(1), target)
    if task.loss == "mse":
        return functional.mse_loss(output.squeeze(1), target)
    raise ValueError(f"unknown loss {task.loss!r} for task {task.name!r}; use ce, bce or mse")


def task_metric(task: Task, output: torch.Tensor, target: torch.Tensor) -> float:
    """Accuracy for classification heads, mean absolute error for the regression head."""
    if task.loss == "ce":
        return float((output.argmax(dim=1) == target).float().mean())
    if task.loss == "bce":
        return float(((output.squeeze(1) > 0).float() == target).float().mean())
    return float((output.squeeze(1) - target).abs().mean())


def batch_losses(
    model: MultiTaskNet, split: Split, rows: torch.Tensor, preference: torch.Tensor | None = None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The shared features and every task's loss on the samples ``rows`` of ``split``."""
    features, outputs = model(split.images[rows], preference)
    losses = [
        task_loss(task, output, target[rows])
        for task, output, target in zip(model.tasks, outputs, split.targets, strict=True)
    ]
    return features, losses
