"""Amortized harmonization: a full solve every N steps, cached smoothed weights in between.

With a [`CombinableLoss`][mogradient.combinable.CombinableLoss], a cached step costs one backward
of ``loss.combined(weights)`` and applies exactly sum_k w_k g_k. Fallbacks are explicit:
every step reports whether it solved, and why it did not use a fresh solution.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from mogradient.ema import WeightEMA
from mogradient.errors import SolverError
from mogradient.harmonizers._base import Harmonization, Harmonizer, validated_flag

logger = logging.getLogger("mogradient.amortize")

# Cached weights are refused when the direction they give is off by more than this
# fraction of itself in the stack's precision (see ``cancellation_ratio``).
_CACHED_DIRECTION_ERROR = 1e-2
# ... or when the Gram cannot tell their direction from zero: ||d||^2 = p^T C p is known
# to float64 round-off of (sum |p_k|)^2, so ratios past ~1/sqrt(eps) are not resolved.
_RESOLVED_RATIO = 0.1 / torch.finfo(torch.float64).eps ** 0.5


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
    the step but does not overwrite the cache. Neither is a solution whose weights exceed
    the gradients' scale and cancel beyond the stack's precision
    (``fallback="cancelling_weights"``, see
    [`cancellation_ratio`][mogradient.amortize.cancellation_ratio]): re-applied to the next steps'
    gradients, such weights give an update many times their size.
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
        self.smooth_solve_steps = validated_flag(smooth_solve_steps, "smooth_solve_steps")
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
        reason = _cancelling(harmonization, _unit_roundoff(jacobian))
        if reason is not None:
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


def cancellation_ratio(weights: torch.Tensor, gram: torch.Tensor | None) -> float:
    """sum_k |w_k| ||g_k|| / ||sum_k w_k g_k|| from the Gram: how much the weights cancel.

    Why: a direction combined in precision u is off by about u times the numerator, so a
    ratio near 1/u means a direction of round-off. It is 1 for non-negative weights on
    aligned gradients and grows as the combination cancels (MGDA's min-norm point near a
    Pareto-stationary one; a Nash-MTL or FairGrad solve on opposed gradients gives weights
    ~1e7 whose direction is noise). Read in cosines, so it holds at any gradient scale;
    objectives with zero weight, or a zero or non-finite squared norm, do not enter it.
    """
    if gram is None:
        return 1.0
    weights = weights.to(torch.float64).cpu()
    gram = gram.to(torch.float64).cpu()
    squared = torch.diagonal(gram)
    kept = (weights != 0) & torch.isfinite(squared) & (squared > 0)
    if not kept.any():
        return 1.0
    norms = torch.sqrt(squared[kept])
    cosines = gram[kept][:, kept] / torch.outer(norms, norms)
    parts = weights[kept] * norms  # w_k ||g_k||: each gradient's share of the direction
    direction = torch.sqrt((parts @ cosines @ parts).clamp_min(0))
    total = parts.abs().sum()
    return float(total / direction) if direction > 0 else float("inf")


def _cancelling(harmonization: Harmonization, unit_roundoff: float) -> str | None:
    """Why the weights must not be cached, or None: they exceed the gradients' own scale
    (sum_k |w_k| ||g_k|| > K max ||g_k||; MGDA's simplex weights at a stationary point,
    whose direction is zero, stay within it) and cancel beyond what the stack's precision
    or the Gram resolves."""
    gram = harmonization.gram
    if gram is None:
        return None
    squared = torch.diagonal(gram.to(torch.float64).cpu())
    norms = torch.sqrt(torch.where(torch.isfinite(squared), squared, 0.0).clamp_min(0))
    spread = float((harmonization.weights.to(torch.float64).cpu().abs() * norms).sum())
    if spread <= len(norms) * float(norms.max()):
        return None
    ratio = cancellation_ratio(harmonization.weights, gram)
    if ratio <= min(_CACHED_DIRECTION_ERROR / unit_roundoff, _RESOLVED_RATIO):
        return None
    return f"cancelling_weights: sum |w_k| ||g_k|| is {ratio:.3g} x ||d||"


def _unit_roundoff(jacobian: torch.Tensor | None) -> float:
    """The precision cached weights meet: float64 stacks' own, float32's otherwise (half
    precision stacks are combined in float32; a Gram passed in is often float32 sums)."""
    if jacobian is not None and jacobian.dtype == torch.float64:
        return torch.finfo(torch.float64).eps
    return torch.finfo(torch.float32).eps


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
