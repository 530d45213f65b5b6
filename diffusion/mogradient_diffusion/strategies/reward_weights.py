"""Weights on the rewards, one per reward: the weighted sum's, GDPO's and reward dropout's."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mogradient_diffusion.config.settings import ConfigError


@dataclass(frozen=True)
class RewardWeightsSettings:
    # One per reward, finite, >= 0, not all 0; None = equal.
    weights: list[float] | None = None

    def __post_init__(self) -> None:
        weights = self.weights
        if weights is not None and (
            not all(math.isfinite(w) and w >= 0 for w in weights) or not any(w > 0 for w in weights)
        ):
            raise ValueError(f"weights must be finite, >= 0 and not all zero, got {weights}")


def reward_weights(settings: RewardWeightsSettings, reward_names: list[str]) -> torch.Tensor:
    """The weights as a float64 tensor [K] (ones when unset); ConfigError unless one per reward."""
    if settings.weights is None:
        return torch.ones(len(reward_names), dtype=torch.float64)
    if len(settings.weights) != len(reward_names):
        raise ConfigError(
            f"strategy.weights has {len(settings.weights)} entries for {len(reward_names)} "
            f"rewards {reward_names}"
        )
    # Through float32, as runs have always read them: a resumed run weighs alike.
    return torch.tensor(settings.weights, dtype=torch.float32).to(torch.float64)
