"""MARBLE: MGDA on the per-reward gradients, normalized, solved every few steps.

Two solve scopes: ``step`` (ours) solves once on the whole optimizer step's gradients
and caches the weights in the amortizer; ``micro_step`` is MARBLE as released, deciding
per micro-step (``release_marble.py``), with the release's balancer options.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mogradient.amortize import Amortizer
from mogradient.harmonizers import MGDA
from mogradient_diffusion.config.settings import ConfigError
from mogradient_diffusion.strategies.amortized import MARBLE_SCHEDULE, AmortizedSettings, amortizer
from mogradient_diffusion.strategies.base import Strategy
from mogradient_diffusion.strategies.release_marble import MicroStepMarble, objective_members

SCOPES = ("step", "micro_step")
SPACES = ("parameters", "outputs")


@dataclass(frozen=True)
class MarbleSettings(AmortizedSettings):
    normalize: bool | None = None  # MGDA normalize-and-rescale (False: plain MGDA ablation)
    # Ablation, equal alpha. Scope step: MGDA with alpha floored at 1/K on the unit
    # gradients (still solving every period, for the norms). Scope micro_step: the
    # release's equal_alpha, 1/K on the advantages, no per-reward gradient ever.
    fixed_alpha: bool | None = None
    # "step" (ours: one solve on the whole step's gradients) or "micro_step" (as
    # released: a solve covers the first micro-step of a solve step); None: step
    solve_scope: str | None = None
    # The release's balancer options: alpha_floor (a bound inside the QP) and
    # reward_weights (scale the unit gradients before the solve; one per objective)
    alpha_lower_bound: float | None = None
    unit_weights: list[float] | None = None
    # micro_step scope: rewards solved as one objective each (the release's
    # reward_groups: the mean of their gradients; alpha / group size each when cached)
    reward_groups: list[list[str]] = field(default_factory=list)
    # Scope step: the share of the step's micro-steps a solve sees (its first ones, in the
    # step's random order; at least one); its weights apply to the whole step. None: 1.
    solve_fraction: float | None = None
    # Scope step: solve on the per-reward gradients w.r.t. the parameters (exact) or
    # w.r.t. the model's output, the velocity (MGDA-UB: no backward through the network
    # for them; the solved micro-steps' graphs are held until the weights are known)
    solve_space: str | None = None
    # Scope step: a cached step also measures its weights' worst cosine in output space
    # (free); when it is negative (the cache went stale), the next step solves
    solve_when_stale: bool | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        fraction = self.solve_fraction
        if fraction is not None and not (math.isfinite(fraction) and 0 < fraction <= 1):
            raise ValueError(f"solve_fraction must be in (0, 1], got {fraction}")
        if self.solve_space is not None and self.solve_space not in SPACES:
            raise ValueError(
                f"solve_space must be parameters (exact) or outputs (MGDA-UB), not "
                f"{self.solve_space!r}"
            )
        scoped = (self.solve_fraction, self.solve_space, self.solve_when_stale)
        if self.scope == "micro_step" and any(v is not None for v in scoped):
            raise ValueError(
                "solve_fraction, solve_space and solve_when_stale are options of solve_scope "
                "step: MARBLE as released solves on its first micro-step"
            )
        if self.scope not in SCOPES:
            raise ValueError(
                "solve_scope must be step (ours: one solve on the whole step) or "
                f"micro_step (MARBLE as released), not {self.solve_scope!r}"
            )
        if self.scope == "step" and self.reward_groups:
            raise ValueError(
                "reward_groups is the release's option: set strategy.solve_scope=micro_step, "
                "or list each reward on its own"
            )
        if self.scope == "micro_step" and (
            self.smooth_solve_steps is not None or self.normalize is False
        ):
            raise ValueError(
                "smooth_solve_steps and normalize=false are options of solve_scope step: the "
                "release normalizes and applies the fresh solution on its solve micro-step"
            )
        if self.fixed_alpha and (self.alpha_lower_bound or self.unit_weights):
            raise ValueError(
                "fixed_alpha fixes alpha: strategy.alpha_lower_bound and strategy.unit_weights "
                "would act on a solve that never happens; remove them"
            )
        if self.normalize is False and self.unit_weights is not None:
            raise ValueError("unit_weights scale the unit gradients and need normalize (true)")
        bound = self.alpha_lower_bound
        if bound is not None and not (math.isfinite(bound) and 0 <= bound < 1):
            raise ValueError(f"alpha_lower_bound must be in [0, 1), got {bound}")

    @property
    def scope(self) -> str:
        return self.solve_scope or "step"


class Marble(Strategy):
    name = "marble"
    settings_type = MarbleSettings

    @classmethod
    def check_config(
        cls,
        name: str,
        settings: MarbleSettings,
        *,
        reward_names: list[str],
        objective: str,
        objective_settings: Any,
    ) -> None:
        """Reward groups and unit weights against the rewards; the release's objective."""
        try:
            objectives = len(objective_members(reward_names, settings.reward_groups))
        except ValueError as error:
            raise ConfigError(f"strategy.reward_groups: {error}") from None
        if settings.scope == "micro_step" and objective != "nft":
            raise ConfigError(
                "strategy.solve_scope=micro_step is MARBLE as released, on DiffusionNFT: "
                f"use objective nft (got {objective!r}), or solve_scope step"
            )
        partial = (settings.solve_fraction or 1.0) < 1 or settings.solve_space == "outputs"
        if (partial or settings.solve_when_stale) and objective != "nft":
            raise ConfigError(
                "strategy.solve_fraction < 1, solve_space outputs and solve_when_stale read "
                f"DiffusionNFT's micro-steps and velocity: use objective nft (got {objective!r})"
            )
        weights = settings.unit_weights
        if weights is not None and (
            len(weights) != objectives or not all(math.isfinite(w) and w > 0 for w in weights)
        ):
            raise ConfigError(
                f"strategy.unit_weights needs one finite number > 0 per MARBLE objective "
                f"({objectives}: the reward groups, then each ungrouped reward), got {weights}"
            )

    @classmethod
    def build(
        cls, name: str, settings: MarbleSettings, reward_names: list[str], seed: int
    ) -> Strategy:
        if settings.scope == "micro_step":
            return ReleaseMarble(name, reward_names, settings)
        count = len(reward_names)
        alpha_floor = 1.0 / count if settings.fixed_alpha and count > 1 else 0.0
        harmonizer = MGDA(
            normalize=True if settings.normalize is None else settings.normalize,
            alpha_floor=alpha_floor,
            alpha_lower_bound=settings.alpha_lower_bound or 0.0,
            unit_weights=settings.unit_weights,
        )
        strategy = cls(name, reward_names, amortizer(harmonizer, settings, MARBLE_SCHEDULE))
        strategy.solve_fraction = settings.solve_fraction or 1.0
        strategy.solve_space = settings.solve_space or "parameters"
        strategy.solve_when_stale = bool(settings.solve_when_stale)
        return strategy


class ReleaseMarble(Marble):
    """MARBLE as released: period 10, warm-up 1, rho 0.7 on alpha unless configured."""

    def __init__(self, name: str, reward_names: Sequence[str], settings: MarbleSettings) -> None:
        period, rho = MARBLE_SCHEDULE
        marble = MicroStepMarble(
            reward_names,
            period=period if settings.period is None else settings.period,
            warmup_steps=1 if settings.warmup_steps is None else settings.warmup_steps,
            rho=rho if settings.rho is None else settings.rho,
            alpha_lower_bound=settings.alpha_lower_bound or 0.0,
            unit_weights=settings.unit_weights,
            groups=settings.reward_groups,
            equal_alpha=bool(settings.fixed_alpha),
        )
        super().__init__(
            name, reward_names, Amortizer(marble.harmonizer, period=marble.period, rho=0.0)
        )
        self.micro_step = marble

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "micro_step": self.micro_step.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if "micro_step" not in state:
            raise ValueError(
                "the checkpoint is of a MARBLE run with solve_scope step; this run has "
                "solve_scope micro_step: resume with the checkpoint's scope"
            )
        self.micro_step.load_state_dict(state["micro_step"])
