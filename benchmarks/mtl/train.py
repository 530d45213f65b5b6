"""One training run: a model, a method, a seed, a fixed budget; metrics after every epoch."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

import mogradient as mg
from benchmarks.mtl.data import Problem, Split
from benchmarks.mtl.methods import Method, bind, extra_parameters, preference_size
from benchmarks.mtl.model import MultiTaskNet, task_loss, task_metric


@dataclass(frozen=True)
class Budget:
    """The same for every method: epochs, batch size, Adam's learning rate."""

    epochs: int
    batch: int
    learning_rate: float
    diagnostics_every: int  # steps between conflict diagnostics (an extra K backwards each)


def seed_everything(seed: int) -> None:
    """LibMTL's PCGrad, GradVac and RLW draw from the global RNGs: seed all three."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def evaluate(model: MultiTaskNet, split: Split, task_indices: list[int]) -> list[float]:
    """Each head's test metric on a whole split (heads in the model's order).

    A preference-conditioned model (COSMOS) is evaluated at the uniform preference 1/K,
    the one trade-off every other method is compared at (equal task weights).
    """
    size = model.preference_size
    preference = torch.full((size,), 1.0 / size) if size else None
    with torch.no_grad():
        _, outputs = model(split.images, preference)
    return [
        task_metric(model.tasks[head], output, split.targets[task])
        for head, (output, task) in enumerate(zip(outputs, task_indices, strict=True))
    ]


def batches(count: int, batch: int, generator: torch.Generator):
    order = torch.randperm(count, generator=generator)
    for start in range(0, count - batch + 1, batch):  # full batches only: equal step sizes
        yield order[start : start + batch]


def train(
    problem: Problem,
    method: Method | None,
    seed: int,
    budget: Budget,
    task_indices: list[int] | None = None,
) -> dict:
    """Train and return per-epoch validation/test metrics, per-step losses and cos_min.

    ``method=None`` with one task index is a single-task baseline (plain backward). A
    method with ``next_preference()`` (COSMOS) draws a preference before every batch's
    forward, and the model takes it with the batch.
    """
    task_indices = list(range(len(problem.tasks))) if task_indices is None else task_indices
    seed_everything(seed)
    tasks = tuple(problem.tasks[index] for index in task_indices)
    model = MultiTaskNet(tasks, preference_size(method, len(tasks)))
    bind(method, model)
    learned = [*model.parameters(), *extra_parameters(method)]
    optimizer = torch.optim.Adam(learned, lr=budget.learning_rate)
    order = torch.Generator().manual_seed(seed)
    record = {"validation": [], "test": [], "losses": [], "cos_min": [], "weights": []}
    step = 0
    for _ in range(budget.epochs):
        for rows in batches(len(problem.train.images), budget.batch, order):
            optimizer.zero_grad()
            preference = method.next_preference() if model.preference_size else None
            features, losses = task_losses(model, problem.train, rows, task_indices, preference)
            if method is None:
                losses[0].backward()
            else:
                diagnose = step % budget.diagnostics_every == 0
                jacobian = (
                    mg.engines.objective_gradients(
                        losses, model.shared_parameters(), retain_graph=True
                    )
                    if diagnose
                    else None
                )
                weights = method.backward(model, losses, features)
                if diagnose:
                    record["cos_min"].append(_worst_cosine(model, jacobian, weights))
                    if weights is not None:
                        record["weights"].append([float(w) for w in weights])
            optimizer.step()
            after_step = getattr(method, "after_step", None)
            if after_step is not None:  # FAMO: the same batch's losses after the step
                after_step(
                    partial(_losses_only, model, problem.train, rows, task_indices, preference)
                )
            record["losses"].append([float(loss.detach()) for loss in losses])
            step += 1
        end_epoch = getattr(method, "end_epoch", None)
        if end_epoch is not None:
            end_epoch()
        record["validation"].append(evaluate(model, problem.validation, task_indices))
        record["test"].append(evaluate(model, problem.test, task_indices))
    return record


def task_losses(
    model: MultiTaskNet,
    split: Split,
    rows: torch.Tensor,
    task_indices: list[int],
    preference: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The shared features and each head's loss on the samples ``rows`` of ``split``."""
    features, outputs = model(split.images[rows], preference)
    losses = [
        task_loss(model.tasks[head], output, split.targets[task][rows])
        for head, (output, task) in enumerate(zip(outputs, task_indices, strict=True))
    ]
    return features, losses


def _losses_only(*arguments) -> list[torch.Tensor]:
    return task_losses(*arguments)[1]


def _worst_cosine(model: MultiTaskNet, jacobian: torch.Tensor, weights) -> float:
    """cos_min between the trunk update a method wrote and each task's trunk gradient."""
    direction = mg.engines.flat_gradient(model.shared_parameters())
    if weights is None or len(weights) != len(jacobian):
        weights = torch.ones(len(jacobian), dtype=torch.float64)
    diagnostics = mg.conflict_diagnostics(weights, jacobian=jacobian, direction=direction)
    value = diagnostics["cos_min"]
    return value if isinstance(value, float) and math.isfinite(value) else math.nan
