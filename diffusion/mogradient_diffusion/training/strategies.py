"""Multi-reward training strategies, all sharing one loop.

A strategy decides two things: which objectives the rewards become (``K`` per-reward
objectives for MARBLE and gradient harmonizers; one scalar objective for the
weighted-sum, GDPO, single-reward and sequential baselines) and, per optimizer step, the
weights on those objectives (from per-objective gradients on full-solve steps, from the
cache otherwise). Weight-only methods (fixed weights, reward dropout) never need
per-objective gradients: they are solved on an identity Gram.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mogradient import MGDA, PCGrad, RewardDropout, make_harmonizer
from mogradient.amortize import AmortizedStep, Amortizer
from mogradient.harmonizers import FixedWeights, Harmonizer, Mean, RandomWeights
from mogradient_diffusion.config.settings import StrategyConfig
from mogradient_diffusion.training.advantages import gdpo_advantages, weighted_reward
from mogradient_diffusion.training.release_marble import MicroStepMarble

_GRADIENT_FREE = (FixedWeights, Mean, RandomWeights)
_RANDOMIZED = ("rlw", "gradvac", "pcgrad")
# (period, rho) when unset: MARBLE's amortized schedule; other harmonizers solve every
# step without smoothing.
MARBLE_SCHEDULE = (10, 0.7)
EVERY_STEP = (1, 0.0)


@dataclass
class Strategy:
    """Objectives from rewards, and an amortized harmonizer over those objectives."""

    name: str
    reward_names: list[str]
    amortizer: Amortizer
    scalar_weights: torch.Tensor | None = None  # scalar strategies: reward weights per column
    stages: list[tuple[list[int], int]] | None = None  # sequential: (reward indices, epochs)
    # gdpo: the scalar objective is GDPO's combined advantage (per-reward group
    # normalization, weighted sum, batch renormalization), not the weighted reward.
    decoupled: bool = False
    # marble with solve_scope micro_step: MARBLE as released decides per micro-step
    # (the trainer asks it); the amortizer's MGDA then serves only the conflict probe.
    micro_step: MicroStepMarble | None = None

    @property
    def gradient_free(self) -> bool:
        harmonizer = self.amortizer.harmonizer
        if isinstance(harmonizer, RewardDropout):
            harmonizer = harmonizer.inner
        return isinstance(harmonizer, _GRADIENT_FREE)

    def objective_names(self, epoch: int) -> list[str]:
        if self.scalar_weights is None:
            return list(self.reward_names)
        active = self._scalar_weights(epoch)
        parts = [name for name, weight in zip(self.reward_names, active, strict=True) if weight]
        return ["+".join(parts)]

    def objective_rewards(
        self, rewards: torch.Tensor, epoch: int, group_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rewards [..., K] as the strategy's objectives [..., K'] (one advantage each).

        Leading dimensions are kept: per-sample [B, K] and per-step [B, S, K] alike.
        GDPO normalizes within prompt groups, so it takes only the whole batch's
        per-sample rewards [B, K] with their ``group_ids`` [B]. Its one column is already
        an advantage (group mean 0, batch std 1): the objective's own normalization then
        changes only the std convention (population: a factor sqrt(N / (N - 1))) and
        clips it (NFT: at ``a_max``, on the sum, not per reward).
        """
        if self.scalar_weights is None:
            return rewards
        if self.decoupled:
            if group_ids is None or rewards.ndim != 2 or group_ids.shape != rewards.shape[:1]:
                raise ValueError(
                    "strategy 'gdpo' normalizes each reward within its prompt group: it needs "
                    "the batch's per-sample rewards [B, K] and group ids [B] (objectives nft "
                    f"and flow_grpo), got rewards {tuple(rewards.shape)} and group ids "
                    f"{None if group_ids is None else tuple(group_ids.shape)}"
                )
            return gdpo_advantages(rewards, group_ids, self.scalar_weights)[:, None]
        flat = rewards.reshape(-1, rewards.shape[-1])
        scalar = weighted_reward(flat, self._scalar_weights(epoch))
        return scalar.reshape(*rewards.shape[:-1], 1)

    def needs_gradients(self) -> bool:
        """Whether the coming optimizer step must compute per-objective gradients (over
        the whole step: a micro-step strategy decides per micro-step instead)."""
        if self.micro_step is not None:
            return False
        return not self.gradient_free and self.amortizer.needs_full_solve()

    def weights(self, jacobian: torch.Tensor | None, count: int) -> AmortizedStep:
        """Weights for this optimizer step: a full solve on ``jacobian``, else the cache."""
        if jacobian is not None:
            return self.amortizer.full_step(jacobian)
        if self.gradient_free:
            return self.amortizer.full_step(gram=torch.eye(count, dtype=torch.float64))
        return self.amortizer.cached_step()

    def state_dict(self) -> dict[str, Any]:
        state = {"amortizer": self.amortizer.state_dict()}
        if self.micro_step is not None:
            state["micro_step"] = self.micro_step.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.amortizer.load_state_dict(state["amortizer"])
        if self.micro_step is not None:
            if "micro_step" not in state:
                raise ValueError(
                    "the checkpoint is of a MARBLE run with solve_scope step; this run has "
                    "solve_scope micro_step: resume with the checkpoint's scope"
                )
            self.micro_step.load_state_dict(state["micro_step"])

    def _scalar_weights(self, epoch: int) -> torch.Tensor:
        if self.stages is None:
            return self.scalar_weights
        weights = torch.zeros(len(self.reward_names), dtype=torch.float64)
        weights[self._stage_rewards(epoch)] = 1.0
        return weights

    def _stage_rewards(self, epoch: int) -> list[int]:
        """Reward indices of the stage ``epoch`` falls in (the last stage runs on after the end)."""
        end = 0
        for indices, epochs in self.stages:
            end += epochs
            if epoch < end:
                return indices
        return self.stages[-1][0]


def build_strategy(config: StrategyConfig, reward_names: list[str], seed: int = 0) -> Strategy:
    """The strategy a config names, with MARBLE's defaults where it applies."""
    count = len(reward_names)
    name = config.name
    if name == "marble" and config.solve_scope == "micro_step":
        return _release_marble(config, reward_names)
    if name == "marble":
        alpha_floor = 1.0 / count if config.fixed_alpha and count > 1 else 0.0
        normalize = True if config.normalize is None else config.normalize
        harmonizer: Harmonizer = MGDA(
            normalize=normalize,
            alpha_floor=alpha_floor,
            alpha_lower_bound=config.alpha_lower_bound or 0.0,
            unit_weights=config.unit_weights,
        )
        return Strategy(name, reward_names, _amortizer(harmonizer, config, MARBLE_SCHEDULE))
    if name in ("weighted_sum", "gdpo", "single", "sequential"):
        return _scalar_strategy(config, reward_names)
    if name == "reward_dropout":
        inner = FixedWeights(config.weights)
        harmonizer = RewardDropout(
            inner,
            0.3 if config.dropout_probability is None else config.dropout_probability,
            warmup_steps=config.dropout_warmup_steps or 0,
            seed=seed,
        )
        return Strategy(name, reward_names, Amortizer(harmonizer, period=1, rho=0.0))
    options = dict(config.options)
    if name in _RANDOMIZED:  # reproducible and resumable: seeded from the run
        options.setdefault("seed", seed)
    harmonizer = PCGrad(seed=seed) if name == "pcgrad" else make_harmonizer(name, **options)
    return Strategy(name, reward_names, _amortizer(harmonizer, config, EVERY_STEP))


def _release_marble(config: StrategyConfig, reward_names: list[str]) -> Strategy:
    """MARBLE as released: period 10, warm-up 1, rho 0.7 on alpha unless configured."""
    period, rho = MARBLE_SCHEDULE
    marble = MicroStepMarble(
        reward_names,
        period=period if config.period is None else config.period,
        warmup_steps=1 if config.warmup_steps is None else config.warmup_steps,
        rho=rho if config.rho is None else config.rho,
        alpha_lower_bound=config.alpha_lower_bound or 0.0,
        unit_weights=config.unit_weights,
        groups=config.reward_groups,
        equal_alpha=bool(config.fixed_alpha),
    )
    amortizer = Amortizer(marble.harmonizer, period=marble.period, rho=0.0)
    return Strategy("marble", reward_names, amortizer, micro_step=marble)


def _scalar_strategy(config: StrategyConfig, reward_names: list[str]) -> Strategy:
    count = len(reward_names)
    stages = None
    if config.name in ("weighted_sum", "gdpo"):
        weights = torch.ones(count) if config.weights is None else torch.tensor(config.weights)
        _check_weights(weights, count)
    elif config.name == "single":
        weights = torch.zeros(count)
        weights[reward_names.index(config.reward)] = 1.0
    else:
        weights = torch.ones(count)
        stages = [
            ([reward_names.index(reward) for reward in stage.rewards], stage.epochs)
            for stage in config.stages
        ]
    amortizer = Amortizer(FixedWeights([1.0]), period=1, rho=0.0)
    return Strategy(
        config.name,
        reward_names,
        amortizer,
        weights.to(torch.float64),
        stages,
        decoupled=config.name == "gdpo",
    )


def _check_weights(weights: torch.Tensor, count: int) -> None:
    """strategy.weights: one per reward, finite, >= 0, not all 0 (one-line errors)."""
    if weights.numel() != count:
        raise ValueError(f"strategy.weights has {weights.numel()} entries for {count} rewards")
    if not torch.isfinite(weights).all() or (weights < 0).any() or not (weights > 0).any():
        raise ValueError(
            f"strategy.weights must be finite, >= 0 and not all 0, got {weights.tolist()}"
        )


def _amortizer(
    harmonizer: Harmonizer, config: StrategyConfig, defaults: tuple[int, float]
) -> Amortizer:
    """Period and rho as configured, each unset one from the strategy's ``defaults``."""
    period = defaults[0] if config.period is None else config.period
    rho = defaults[1] if config.rho is None else config.rho
    return Amortizer(
        harmonizer,
        period=period,
        warmup_steps=config.warmup_steps or 0,
        rho=rho,
        smooth_solve_steps=bool(config.smooth_solve_steps),
    )
