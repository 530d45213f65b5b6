"""Rewards by name, so configs can list them as data: ``make_reward("ocr", psm=7)``."""

from __future__ import annotations

from typing import Any, TypeVar

from .base import Reward

REWARDS: dict[str, type[Reward]] = {}

R = TypeVar("R", bound=type[Reward])


def register_reward(cls: R) -> R:
    """Class decorator: make ``cls`` constructible by ``make_reward(cls.name)``."""
    if not isinstance(getattr(cls, "name", None), str) or not cls.name:
        raise TypeError(
            f"@register_reward: {cls.__qualname__} has no `name`; give it a class attribute "
            'such as name = "my_reward", the name configs list it by'
        )
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
