"""The interface every logger implements, and the flat scalars each backend receives.

metrics.jsonl nests each optimizer step under its epoch and indexes per-objective values
by position (``harmonize/cos/0``, a ``weights`` list); dashboards want flat, named series.
``epoch_scalars`` and ``step_scalars`` make that translation once, with names from
``metric_keys``, so every backend logs the same names.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from mogradient_diffusion.config.settings import RunConfig
from mogradient_diffusion.runs import metric_keys as keys


@dataclass(frozen=True)
class LogTarget:
    """What a logger is opened on: the run directory, its settings, where a resume starts
    (a backend drops or keeps what was logged past it), and the whole config to record."""

    directory: Path
    settings: RunConfig = field(default_factory=RunConfig)
    resume_epoch: int = 0
    resume_optimizer_step: int = 0
    config: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EpochLog:
    """One epoch as the loggers receive it: metrics.jsonl's ``record``, the global index
    of its first optimizer step, and a grid of sample images (H x W x 3 uint8) or None."""

    epoch: int
    record: dict[str, Any]
    first_optimizer_step: int = 0
    samples: np.ndarray | None = None

    def steps(self) -> Iterator[tuple[int, dict[str, float]]]:
        """(global optimizer step, its named scalars) for each step of the epoch."""
        names = self.record.get(keys.OBJECTIVES) or []
        for offset, step in enumerate(self.record.get(keys.OPTIMIZER_STEPS) or []):
            yield self.first_optimizer_step + offset, step_scalars(step, names)


class Logger:
    """A destination for a run's records (rank 0 only). ``requires``: the package it
    needs, checked with the config; ``install``: how to get it."""

    name: ClassVar[str]
    requires: ClassVar[str | None] = None
    install: ClassVar[str] = ""

    def __init__(self, target: LogTarget) -> None:
        self.target = target

    def log(self, epoch: EpochLog) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Flush and release the backend; called once, also when the run fails."""


def epoch_scalars(record: dict[str, Any]) -> dict[str, float]:
    """The epoch's finite numeric entries (lists, text and the step index left out)."""
    return {
        key: float(value)
        for key, value in record.items()
        if key != keys.STEP and _finite_number(value)
    }


def step_scalars(step: dict[str, Any], objectives: list[str]) -> dict[str, float]:
    """One optimizer step's harmonizer diagnostics, per-objective values named by objective
    (by position where the step reports another count, as MARBLE-as-released's groups)."""
    weights = step.get(keys.WEIGHTS) or []
    names = objectives if len(objectives) == len(weights) else [str(i) for i in range(len(weights))]
    scalars: dict[str, Any] = {keys.step_weight(n): w for n, w in zip(names, weights, strict=True)}
    for index, name in enumerate(names):
        scalars[keys.step_cos(name)] = step.get(keys.harmonize_of("cos", index))
        scalars[keys.step_norm(name)] = step.get(keys.harmonize_of("norm", index))
    scalars[keys.STEP_COS_MIN] = step.get(keys.COS_MIN)
    scalars[keys.STEP_SOLVED] = step.get(keys.SOLVED)
    scalars[keys.STEP_FALLBACK] = 1.0 if step.get(keys.FALLBACK) else 0.0
    scalars[keys.STEP_GRAD_NORM] = step.get(keys.GRAD_NORM)
    for key in keys.STALENESS:
        scalars[keys.step_scalar(key)] = step.get(key)
    return {key: float(value) for key, value in scalars.items() if _finite_number(value)}


def _finite_number(value: Any) -> bool:
    numeric = isinstance(value, int | float) and not isinstance(value, bool)
    return numeric and math.isfinite(value)


def remembered_id(target: LogTarget, backend: str) -> str | None:
    """The backend run a resumed run continues (``<run>/<backend>_run_id``), None at first."""
    path = target.directory / f"{backend}_run_id"
    return path.read_text().strip() if path.exists() else None


def remember_id(target: LogTarget, backend: str, run_id: str) -> None:
    (target.directory / f"{backend}_run_id").write_text(run_id + "\n")
