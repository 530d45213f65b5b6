"""Rewards by name, so configs can list them as data: ``make_reward("ocr", psm=7)``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from .base import Reward
from .reward_set import RewardSet

REWARDS: dict[str, type[Reward]] = {}

R = TypeVar("R", bound=type[Reward])


def register_reward(cls: R) -> R:
    """Class decorator: make ``cls`` constructible by ``make_reward(cls.name)``."""
    existing = REWARDS.get(cls.name)
    if existing is not None and existing is not cls:
        raise ValueError(f"reward name {cls.name!r} is already taken by {existing.__qualname__}")
    REWARDS[cls.name] = cls
    return cls


def make_reward(name: str, **options: Any) -> Reward:
    """Build the reward registered as ``name`` with its constructor ``options``."""
    if name not in REWARDS:
        raise KeyError(f"unknown reward {name!r}; available: {', '.join(sorted(REWARDS))}")
    try:
        return REWARDS[name](**options)
    except TypeError as exc:
        raise TypeError(f"reward {name!r}: bad options {sorted(options)}: {exc}") from exc


def make_reward_set(spec: Sequence[str] | Mapping[str, Mapping[str, Any]]) -> RewardSet:
    """A ``RewardSet`` from reward names, or from ``{name: options}`` (config files)."""
    if isinstance(spec, Mapping):
        return RewardSet([make_reward(name, **dict(opts)) for name, opts in spec.items()])
    if isinstance(spec, str):
        raise TypeError("make_reward_set expects a list of names, not one string")
    return RewardSet([make_reward(name) for name in spec])
