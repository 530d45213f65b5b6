"""The strategy interface: what the training loop asks of a multi-reward strategy.

A strategy decides two things: which objectives the rewards become (``K`` per-reward
objectives for MARBLE and gradient harmonizers; one scalar objective for the
weighted-sum, GDPO, single-reward and sequential baselines) and, per optimizer step, the
weights on those objectives (from per-objective gradients on full-solve steps, from the
cache otherwise). Weight-only methods (fixed weights, reward dropout) never need
per-objective gradients: they are solved on an identity Gram.

Each strategy is a subclass registered by name (``mogradient_diffusion.strategies``) with
its own settings dataclass, whose fields are the keys its ``strategy:`` config section
takes besides ``name``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from mogradient.amortize import AmortizedStep, Amortizer
from mogradient.harmonizers import FixedWeights, Mean, RandomWeights, RewardDropout

if TYPE_CHECKING:
    from mogradient_diffusion.strategies.release_marble import MicroStepMarble

_GRADIENT_FREE = (FixedWeights, Mean, RandomWeights)


class Strategy:
    """Objectives from rewards, and an amortized harmonizer over those objectives.

    The base maps rewards to themselves (one objective per reward). Subclasses set
    ``settings_type`` (a frozen dataclass whose ``__post_init__`` raises ValueError
    naming the bad field) and implement
    [`build`][mogradient_diffusion.strategies.base.Strategy.build];
    [`check_config`][mogradient_diffusion.strategies.base.Strategy.check_config] refuses settings
    the rest of the config cannot honour, before any model loads.
    """

    settings_type: ClassVar[type]
    # Scalar strategies: the weights on the rewards that make their one objective.
    scalar_weights: torch.Tensor | None = None
    # marble with solve_scope micro_step: MARBLE as released decides per micro-step (the
    # trainer asks it); the amortizer's MGDA then serves only the conflict probe.
    micro_step: MicroStepMarble | None = None
    # How much of a step a solve sees: the share of its micro-steps (the first ones), in
    # parameter space or in output space (MGDA-UB); and whether cached steps measure
    # their staleness in output space, making the next step a solve when it shows.
    solve_fraction: float = 1.0
    solve_space: str = "parameters"
    solve_when_stale: bool = False
    stale: bool = False  # set by a cached step whose weights conflict in output space

    def __init__(self, name: str, reward_names: Sequence[str], amortizer: Amortizer) -> None:
        self.name = name
        self.reward_names = list(reward_names)
        self.amortizer = amortizer

    @classmethod
    def build(cls, name: str, settings: Any, reward_names: list[str], seed: int) -> Strategy:
        """The strategy ``name`` with ``settings`` over ``reward_names``; randomized
        methods draw from ``seed`` (the run's), so runs are reproducible and resumable."""
        raise NotImplementedError

    @classmethod
    def check_config(
        cls,
        name: str,
        settings: Any,
        *,
        reward_names: list[str],
        objective: str,
        objective_settings: Any,
    ) -> None:
        """Raise ConfigError (naming the key) for settings that the rewards or the
        objective make impossible; the settings' own ranges are checked on construction."""
        return None

    @property
    def gradient_free(self) -> bool:
        harmonizer = self.amortizer.harmonizer
        if isinstance(harmonizer, RewardDropout):
            harmonizer = harmonizer.inner
        return isinstance(harmonizer, _GRADIENT_FREE)

    def objective_names(self, epoch: int) -> list[str]:
        return list(self.reward_names)

    def objective_rewards(
        self, rewards: torch.Tensor, epoch: int, group_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rewards [..., K] as the strategy's objectives [..., K'] (one advantage each).

        Leading dimensions are kept: per-sample [B, K] and per-step [B, S, K] alike.
        ``group_ids`` [B] are the prompt groups of per-sample rewards, for strategies
        that normalize within them.
        """
        return rewards

    def needs_gradients(self) -> bool:
        """Whether the coming optimizer step must compute per-objective gradients (over
        the whole step: a micro-step strategy decides per micro-step instead)."""
        if self.micro_step is not None:
            return False
        return not self.gradient_free and (self.stale or self.amortizer.needs_full_solve())

    def solve_pieces(self, pieces: int) -> int | None:
        """How many of a step's ``pieces`` micro-steps its solve sees (None: all)."""
        if self.solve_fraction >= 1:
            return None
        return max(1, math.ceil(self.solve_fraction * pieces - 1e-9))

    @property
    def solve_sees_step(self) -> bool:
        """Whether a solve's gradients are the whole step's, in parameter space (not as
        released, whose solve covers one micro-step)."""
        return (
            self.micro_step is None
            and self.solve_fraction >= 1
            and self.solve_space == "parameters"
        )

    def weights(self, jacobian: torch.Tensor | None, count: int) -> AmortizedStep:
        """Weights for this optimizer step: a full solve on ``jacobian``, else the cache."""
        if jacobian is not None:
            self.stale = False
            return self.amortizer.full_step(jacobian)
        if self.gradient_free:
            return self.amortizer.full_step(gram=torch.eye(count, dtype=torch.float64))
        return self.amortizer.cached_step()

    def state_dict(self) -> dict[str, Any]:
        return {"amortizer": self.amortizer.state_dict(), "stale": self.stale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.amortizer.load_state_dict(state["amortizer"])
        self.stale = bool(state.get("stale", False))  # absent in checkpoints before it
