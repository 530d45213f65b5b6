"""Δm% against single-task training, validation-based epoch selection, mean ± std over seeds."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from benchmarks.mtl.data import Task


def delta_m(tasks: Sequence[Task], metrics: Sequence[float], baseline: Sequence[float]) -> float:
    """Δm% = 100/K sum_k (-1)^[higher is better] (M_k - B_k) / B_k; lower is better.

    The convention of Maninis et al. 2019 as used by Nash-MTL, CAGrad and FAMO: a negative
    Δm% means the multi-task model beats the single-task models on average.
    """
    if not (len(tasks) == len(metrics) == len(baseline)):
        raise ValueError(
            f"{len(tasks)} tasks but {len(metrics)} metrics and {len(baseline)} baseline values"
        )
    total = 0.0
    for task, value, reference in zip(tasks, metrics, baseline, strict=True):
        change = (value - reference) / reference
        total += -change if task.higher_is_better else change
    return 100.0 * total / len(tasks)


def best_single_task_epoch(task: Task, validation: Sequence[float]) -> int:
    """The epoch with the best validation metric of a single-task run (first on ties)."""
    key = (lambda e: -validation[e]) if task.higher_is_better else (lambda e: validation[e])
    return min(range(len(validation)), key=key)


def best_multi_task_epoch(
    tasks: Sequence[Task],
    validation: Sequence[Sequence[float]],
    validation_baseline: Sequence[float],
) -> int:
    """The epoch with the lowest validation Δm% (the multi-task analogue of early stopping)."""
    return min(
        range(len(validation)),
        key=lambda epoch: delta_m(tasks, validation[epoch], validation_baseline),
    )


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    values = list(values)
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return statistics.fmean(values), spread
