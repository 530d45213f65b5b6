"""The solve schedule that strategies built on a gradient harmonizer share.

A full solve every ``period`` optimizer steps (after ``warmup_steps`` that all solve),
the cached weights in between, smoothed by an EMA ``rho``. Unset (None) means the
strategy's own default: MARBLE solves every 10 steps with rho 0.7, other harmonizers
every step without smoothing. None stays in the settings (not the default's value) so
that a run's saved config reads the same as when it was saved.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mogradient.amortize import Amortizer
from mogradient.harmonizers import Harmonizer

# (period, rho) when unset
MARBLE_SCHEDULE = (10, 0.7)
EVERY_STEP = (1, 0.0)


@dataclass(frozen=True)
class AmortizedSettings:
    period: int | None = None  # full solve every N optimizer steps (1 = every step)
    warmup_steps: int | None = None
    rho: float | None = None  # EMA of cached weights (0 = none)
    # Ablation: solve steps apply the EMA-smoothed weights, not the fresh solution.
    smooth_solve_steps: bool | None = None

    def __post_init__(self) -> None:
        check_optional("period", self.period, lambda v: v >= 1, ">= 1")
        check_optional("warmup_steps", self.warmup_steps, lambda v: v >= 0, ">= 0")
        check_optional("rho", self.rho, lambda v: 0 <= v < 1, "in [0, 1)")


def check_optional(field: str, value: Any, check: Callable[[Any], bool], expected: str) -> None:
    """ValueError naming ``field`` when it is set and out of range (unset is the default)."""
    if value is not None and not check(value):
        raise ValueError(f"{field} must be {expected}, got {value}")


def amortizer(
    harmonizer: Harmonizer, settings: AmortizedSettings, defaults: tuple[int, float]
) -> Amortizer:
    """Period and rho as configured, each unset one from the strategy's ``defaults``."""
    period = defaults[0] if settings.period is None else settings.period
    rho = defaults[1] if settings.rho is None else settings.rho
    return Amortizer(
        harmonizer,
        period=period,
        warmup_steps=settings.warmup_steps or 0,
        rho=rho,
        smooth_solve_steps=bool(settings.smooth_solve_steps),
    )
