"""Multi-reward training strategies by config name, all sharing one loop.

``strategy: {name: marble, period: 2, ...}`` in a config picks one; its options are the
fields of the strategy's settings dataclass. A name registered here picks that strategy
(its module is imported on first use); any other core harmonizer's name picks the
generic harmonizer strategy over it (``harmonizer.py``). The interface they implement is
[`Strategy`][mogradient_diffusion.strategies.base.Strategy].
"""

from __future__ import annotations

from typing import Any

from mogradient.harmonizers import HARMONIZERS
from mogradient.registry import Registry, UnknownNameError, did_you_mean, normalize
from mogradient_diffusion.config.settings import ConfigError
from mogradient_diffusion.strategies.base import Strategy
from mogradient_diffusion.strategies.harmonizer import (
    HarmonizerStrategy,
    trainable_harmonizers,
    unfit_reason,
)

STRATEGIES: Registry[type[Strategy]] = Registry("strategy")
STRATEGIES.add("marble", "mogradient_diffusion.strategies.marble:Marble")
STRATEGIES.add("weighted_sum", "mogradient_diffusion.strategies.scalar:WeightedSum")
STRATEGIES.add("gdpo", "mogradient_diffusion.strategies.scalar:Gdpo")
STRATEGIES.add("single", "mogradient_diffusion.strategies.scalar:Single")
STRATEGIES.add("sequential", "mogradient_diffusion.strategies.scalar:Sequential")
STRATEGIES.add(
    "reward_dropout", "mogradient_diffusion.strategies.reward_dropout:RewardDropoutStrategy"
)


def strategy_type(name: str) -> type[Strategy]:
    """The class of strategy ``name``: a registered one, else the harmonizer strategy for
    a core harmonizer's name. UnknownNameError with the choices, or ConfigError saying
    why a harmonizer cannot train on rewards."""
    if name in STRATEGIES:
        return STRATEGIES[name]
    if name in HARMONIZERS:
        reason = unfit_reason(HARMONIZERS[name])
        if reason is not None:
            raise ConfigError(f"strategy.name={name!r} is not a training strategy: {reason}")
        return HarmonizerStrategy
    choices = sorted({*STRATEGIES, *trainable_harmonizers()})
    hint = did_you_mean(normalize(name), choices)
    raise UnknownNameError(f"unknown strategy {name!r}{hint}; choose one of: {', '.join(choices)}")


def build_strategy(name: str, settings: Any, reward_names: list[str], seed: int = 0) -> Strategy:
    """The strategy ``name`` with its ``settings`` (an instance of its settings_type)."""
    cls = strategy_type(name)
    if type(settings) is not cls.settings_type:
        raise TypeError(
            f"strategy {name!r} takes {cls.settings_type.__name__} settings, "
            f"got {type(settings).__name__}"
        )
    return cls.build(name, settings, list(reward_names), seed)


__all__ = ["STRATEGIES", "Strategy", "build_strategy", "strategy_type"]
