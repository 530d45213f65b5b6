"""The scalar baselines: one objective made of the rewards, no per-reward gradient.

``weighted_sum`` (fixed weights), ``gdpo`` (per-reward group normalization before the
sum), ``single`` (one reward) and ``sequential`` (one set of rewards per stage of epochs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mogradient.amortize import Amortizer
from mogradient.harmonizers import FixedWeights
from mogradient_diffusion.advantages import gdpo_advantages, weighted_reward
from mogradient_diffusion.config.settings import ConfigError
from mogradient_diffusion.strategies.base import Strategy
from mogradient_diffusion.strategies.reward_weights import RewardWeightsSettings, reward_weights


class ScalarStrategy(Strategy):
    """One objective: the rewards' weighted sum, with weights that may change by epoch."""

    def __init__(self, name: str, reward_names: Sequence[str], weights: torch.Tensor) -> None:
        super().__init__(name, reward_names, Amortizer(FixedWeights([1.0]), period=1, rho=0.0))
        self.scalar_weights = weights.to(torch.float64)

    def epoch_weights(self, epoch: int) -> torch.Tensor:
        """The weights on the rewards in ``epoch``."""
        return self.scalar_weights

    def objective_names(self, epoch: int) -> list[str]:
        active = self.epoch_weights(epoch)
        parts = [name for name, weight in zip(self.reward_names, active, strict=True) if weight]
        return ["+".join(parts)]

    def objective_rewards(
        self, rewards: torch.Tensor, epoch: int, group_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        flat = rewards.reshape(-1, rewards.shape[-1])
        scalar = weighted_reward(flat, self.epoch_weights(epoch))
        return scalar.reshape(*rewards.shape[:-1], 1)


class WeightedSum(ScalarStrategy):
    name = "weighted_sum"
    settings_type = RewardWeightsSettings

    @classmethod
    def check_config(
        cls,
        name: str,
        settings: RewardWeightsSettings,
        *,
        reward_names: list[str],
        objective: str,
        objective_settings: Any,
    ) -> None:
        reward_weights(settings, reward_names)

    @classmethod
    def build(
        cls, name: str, settings: RewardWeightsSettings, reward_names: list[str], seed: int
    ) -> Strategy:
        return cls(name, reward_names, reward_weights(settings, reward_names))


class Gdpo(WeightedSum):
    """GDPO: the scalar objective is the combined advantage (per-reward group
    normalization, weighted sum, batch renormalization), not the weighted reward."""

    name = "gdpo"

    @classmethod
    def check_config(
        cls,
        name: str,
        settings: RewardWeightsSettings,
        *,
        reward_names: list[str],
        objective: str,
        objective_settings: Any,
    ) -> None:
        """The objective must take per-sample rewards and keep the batch std: GDPO hands
        it one advantage already normalized per prompt group and over the batch."""
        reward_weights(settings, reward_names)
        if objective == "sdpo":
            raise ConfigError(
                "strategy 'gdpo' normalizes per-sample rewards within prompt groups; objective "
                "'sdpo' works on dense per-step rewards: use objective nft or flow_grpo"
            )
        if getattr(objective_settings, "advantage_std", "global") != "global":
            raise ConfigError(
                "strategy 'gdpo' renormalizes its combined advantage over the batch; "
                "objective.advantage_std=group would normalize it per prompt group again: "
                "leave it at global"
            )

    def objective_rewards(
        self, rewards: torch.Tensor, epoch: int, group_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """GDPO normalizes within prompt groups, so it takes only the whole batch's
        per-sample rewards [B, K] with their ``group_ids`` [B]. Its one column is already
        an advantage (group mean 0, batch std 1): the objective's own normalization then
        changes only the std convention (population: a factor sqrt(N / (N - 1))) and
        clips it (NFT: at ``a_max``, on the sum, not per reward).
        """
        if group_ids is None or rewards.ndim != 2 or group_ids.shape != rewards.shape[:1]:
            raise ValueError(
                "strategy 'gdpo' normalizes each reward within its prompt group: it needs "
                "the batch's per-sample rewards [B, K] and group ids [B] (objectives nft "
                f"and flow_grpo), got rewards {tuple(rewards.shape)} and group ids "
                f"{None if group_ids is None else tuple(group_ids.shape)}"
            )
        return gdpo_advantages(rewards, group_ids, self.scalar_weights)[:, None]


@dataclass(frozen=True)
class SingleSettings:
    reward: str | None = None  # the one reward trained on


class Single(ScalarStrategy):
    name = "single"
    settings_type = SingleSettings

    @classmethod
    def check_config(
        cls,
        name: str,
        settings: SingleSettings,
        *,
        reward_names: list[str],
        objective: str,
        objective_settings: Any,
    ) -> None:
        if settings.reward not in reward_names:
            raise ConfigError(
                f"strategy 'single' needs strategy.reward set to one of {reward_names}"
            )

    @classmethod
    def build(
        cls, name: str, settings: SingleSettings, reward_names: list[str], seed: int
    ) -> Strategy:
        weights = torch.zeros(len(reward_names))
        weights[reward_names.index(settings.reward)] = 1.0
        return cls(name, reward_names, weights)


@dataclass(frozen=True)
class StageConfig:
    rewards: list[str]
    epochs: int

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise ValueError(f"epochs must be >= 1 (every sequential stage), got {self.epochs}")


@dataclass(frozen=True)
class SequentialSettings:
    stages: list[StageConfig] = field(default_factory=list)


class Sequential(ScalarStrategy):
    """One stage of rewards after another; the last stage runs on after the end."""

    name = "sequential"
    settings_type = SequentialSettings

    def __init__(
        self, name: str, reward_names: Sequence[str], stages: list[tuple[list[int], int]]
    ) -> None:
        super().__init__(name, reward_names, torch.ones(len(reward_names)))
        self.stages = stages  # (reward indices, epochs)

    @classmethod
    def check_config(
        cls,
        name: str,
        settings: SequentialSettings,
        *,
        reward_names: list[str],
        objective: str,
        objective_settings: Any,
    ) -> None:
        if not settings.stages:
            raise ConfigError("strategy 'sequential' needs strategy.stages: [{rewards, epochs}]")
        for stage in settings.stages:
            unknown = sorted(set(stage.rewards) - set(reward_names))
            if unknown:
                raise ConfigError(f"sequential stage names unknown rewards {unknown}")

    @classmethod
    def build(
        cls, name: str, settings: SequentialSettings, reward_names: list[str], seed: int
    ) -> Strategy:
        stages = [
            ([reward_names.index(reward) for reward in stage.rewards], stage.epochs)
            for stage in settings.stages
        ]
        return cls(name, reward_names, stages)

    def epoch_weights(self, epoch: int) -> torch.Tensor:
        weights = torch.zeros(len(self.reward_names), dtype=torch.float64)
        weights[self._stage_rewards(epoch)] = 1.0
        return weights

    def _stage_rewards(self, epoch: int) -> list[int]:
        """Reward indices of the stage ``epoch`` falls in."""
        end = 0
        for indices, epochs in self.stages:
            end += epochs
            if epoch < end:
                return indices
        return self.stages[-1][0]
