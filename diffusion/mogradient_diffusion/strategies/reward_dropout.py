"""Reward dropout: fixed weights on the rewards, each reward left out of a step at random."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mogradient.amortize import Amortizer
from mogradient.harmonizers import FixedWeights, RewardDropout
from mogradient_diffusion.strategies.amortized import check_optional
from mogradient_diffusion.strategies.base import Strategy
from mogradient_diffusion.strategies.reward_weights import RewardWeightsSettings, reward_weights


@dataclass(frozen=True)
class RewardDropoutSettings(RewardWeightsSettings):
    dropout_probability: float | None = None  # default 0.3
    dropout_warmup_steps: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        probability = self.dropout_probability
        check_optional("dropout_probability", probability, lambda v: 0 <= v <= 1, "in [0, 1]")
        check_optional("dropout_warmup_steps", self.dropout_warmup_steps, lambda v: v >= 0, ">= 0")


class RewardDropoutStrategy(Strategy):
    name = "reward_dropout"
    settings_type = RewardDropoutSettings

    @classmethod
    def check_config(
        cls,
        name: str,
        settings: RewardDropoutSettings,
        *,
        reward_names: list[str],
        objective: str,
        objective_settings: Any,
    ) -> None:
        reward_weights(settings, reward_names)

    @classmethod
    def build(
        cls, name: str, settings: RewardDropoutSettings, reward_names: list[str], seed: int
    ) -> Strategy:
        harmonizer = RewardDropout(
            FixedWeights(settings.weights),
            0.3 if settings.dropout_probability is None else settings.dropout_probability,
            warmup_steps=settings.dropout_warmup_steps or 0,
            seed=seed,
        )
        return cls(name, reward_names, Amortizer(harmonizer, period=1, rho=0.0))
