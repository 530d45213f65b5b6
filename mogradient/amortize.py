"""Amortized harmonization: a full solve every N steps, cached smoothed weights in between.

With a :class:`~mogradient.combinable.CombinableLoss`, a cached step costs one backward
of ``loss.combined(weights)`` and applies exactly sum_k w_k g_k. Fallbacks are explicit:
every step reports whether it solved, and why it did not use a fresh solution.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from mogradient.ema import WeightEMA
from mogradient.errors import SolverError
from mogradient.harmonizers.base import Harmonization, Harmonizer

logger = logging.getLogger("mogradient.amortize")


@dataclass(frozen=True)
class AmortizedStep:
    """The weights to apply this step and how they were obtained."""

    weights: torch.Tensor
    solved: bool
    harmonization: Harmonization | None = None
    fallback: str | None = None


class Amortizer:
    """Schedule full solves (every step during warm-up, then every ``period`` steps) and cache.

    After each successful full solve the raw-gradient weights are folded into an EMA
    (``rho``; 0 disables smoothing). As in MARBLE's published pseudocode, the solve step
    applies its fresh solution (so its update conflicts with no objective: MGDA's
    min-norm guarantee) and the smoothed weights serve the cached steps that follow;
    ``smooth_solve_steps=True`` applies the smoothed weights on solve steps too (an
    ablation, and this package's behaviour before). A full solve that cannot produce a
    fresh solution (no usable gradient, all-zero weights, solver error) keeps the cache
    and says so; a solve with a single usable objective applies that objective alone for
    the step but does not overwrite the cache.
    """

    def __init__(
        self,
        harmonizer: Harmonizer,
        period: int = 10,
        warmup_steps: int = 0,
        rho: float = 0.7,
        smooth_solve_steps: bool = False,
    ) -> None:
        if period < 1:
            raise ValueError(f"period must be >= 1 (1 = solve every step), got {period}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if not harmonizer.direction_is_weighted_sum:
            raise ValueError(
                f"{type(harmonizer).__name__} computes its direction coordinate by coordinate, "
                "not as a weighted sum of the gradients: cached weights cannot reproduce it. "
                "Amortize a harmonizer whose direction is sum_k w_k g_k (e.g. MGDA, UPGrad), "
                "or call this one on the full gradient stack every step."
            )
        self.harmonizer = harmonizer
        self.period = int(period)
        self.warmup_steps = int(warmup_steps)
        self.ema = WeightEMA(rho)
        self.smooth_solve_steps = bool(smooth_solve_steps)
        self.step = 0
        self._steps_since_solve: int | None = None

    @property
    def steps_since_solve(self) -> int | None:
        """Cached steps since the last fresh solve (0 on a solve step; None before any)."""
        return self._steps_since_solve

    def needs_full_solve(self) -> bool:
        """Whether the coming step must compute per-objective gradients."""
        if self.ema.value is None or self.step < self.warmup_steps:
            return True
        return self._steps_since_solve is None or self._steps_since_solve >= self.period - 1

    def full_step(
        self, jacobian: torch.Tensor | None = None, *, gram: torch.Tensor | None = None
    ) -> AmortizedStep:
        """Solve on this step's per-objective gradients (or their Gram) and update the cache."""
        count = (jacobian if jacobian is not None else gram).shape[0]
        try:
            harmonization = self.harmonizer(jacobian, gram=gram)
        except SolverError as error:
            return self._fallback_step(f"solver_failure: {error}", count)
        if harmonization.fallback == "no_usable_objective" or not harmonization.weights.any():
            reason = harmonization.fallback or "zero_weights"
            return self._fallback_step(reason, count, harmonization)
        self._steps_since_solve = 0
        self.step += 1
        if harmonization.fallback == "single_objective":
            logger.info("full solve had a single usable objective; cache kept")
            return AmortizedStep(harmonization.weights, True, harmonization, "single_objective")
        smoothed = self.ema.update(harmonization.weights)
        if not self.smooth_solve_steps:
            return AmortizedStep(
                harmonization.weights.clone(), True, harmonization, harmonization.fallback
            )
        # Smoothing must not put weight back on a gradient that is zero or NaN this step.
        smoothed[_zero_or_non_finite(harmonization)] = 0.0
        return AmortizedStep(smoothed, True, harmonization, harmonization.fallback)

    def cached_step(self) -> AmortizedStep:
        """Weights for a step without per-objective gradients."""
        if self.ema.value is None:
            raise RuntimeError("no cached weights yet: the first step must be a full solve")
        self.step += 1
        if self._steps_since_solve is not None:
            self._steps_since_solve += 1
        return AmortizedStep(self.ema.value.clone(), solved=False)

    def state_dict(self) -> dict[str, object]:
        return {
            "step": self.step,
            "steps_since_solve": self._steps_since_solve,
            "ema": self.ema.state_dict(),
            "harmonizer": self.harmonizer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.step = int(state["step"])  # type: ignore[arg-type]
        self._steps_since_solve = state["steps_since_solve"]  # type: ignore[assignment]
        self.ema.load_state_dict(state["ema"])  # type: ignore[arg-type]
        self.harmonizer.load_state_dict(state.get("harmonizer", {}))  # type: ignore[arg-type]

    def _fallback_step(
        self, reason: str, count: int, harmonization: Harmonization | None = None
    ) -> AmortizedStep:
        logger.warning("harmonization fallback at step %d: %s", self.step, reason)
        self.step += 1
        if self._steps_since_solve is not None:
            self._steps_since_solve += 1
        if self.ema.value is not None:
            return AmortizedStep(self.ema.value.clone(), False, harmonization, reason)
        return AmortizedStep(torch.zeros(count, dtype=torch.float64), False, harmonization, reason)


def _zero_or_non_finite(harmonization: Harmonization) -> torch.Tensor:
    """Objectives dropped for a zero or non-finite gradient this step.

    Both tests matter: an objective dropped out by RewardDropout has a positive squared
    norm, and a usable float64 gradient below ~1e-162 has a zero one in the float64 Gram
    (its square underflows) but is not dropped.
    """
    diagonal = torch.diagonal(harmonization.gram).cpu()
    dropped = torch.zeros(len(diagonal), dtype=torch.bool)
    dropped[list(harmonization.dropped)] = True
    return dropped & ~(torch.isfinite(diagonal) & (diagonal > 0))
