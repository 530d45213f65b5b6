"""Rewards by name, so configs can list them as data: ``make_reward("ocr", psm=7)``.

A reward is known by the name its config gives it: ``make_reward("pickscore")`` builds
the ``pick_score`` reward under its old spelling, so the run's metrics, strategy weights
and saved state keep the key the config wrote.
"""

from __future__ import annotations

from typing import Any, TypeVar

from mogradient.registry import Registry

from .base import Reward

REWARDS: Registry[type[Reward]] = Registry("reward")

R = TypeVar("R", bound=type[Reward])


def register_reward(cls: R) -> R:
    """Class decorator: make ``cls`` constructible by ``make_reward(cls.name)`` (or by
    any of ``cls.aliases``)."""
    if not isinstance(getattr(cls, "name", None), str) or not cls.name:
        raise TypeError(
            f"@register_reward: {cls.__qualname__} has no `name`; give it a class attribute "
            'such as name = "my_reward", the name configs list it by'
        )
    REWARDS.register(aliases=cls.aliases)(cls)
    return cls


def make_reward(name: str, **options: Any) -> Reward:
    """Build the reward registered as ``name`` (or an old spelling of it) with its
    constructor ``options``; the reward keeps ``name`` as written."""
    cls = REWARDS[name]
    try:
        reward = cls(**options)
    except TypeError as exc:
        raise TypeError(f"reward {name!r}: bad options {sorted(options)}: {exc}") from exc
    reward.name = name
    return reward
