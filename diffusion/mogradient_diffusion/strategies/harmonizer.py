"""The generic harmonizer strategy: any core harmonizer, by its registry name.

One objective per reward; the harmonizer weighs their gradients every step, or on the
amortized schedule when ``period`` is set. Its own options go in ``strategy.options``.
Methods that draw random numbers are seeded from the run, so runs are reproducible and
resumable.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from mogradient.harmonizers import HARMONIZERS, Harmonizer, Krum, make_harmonizer
from mogradient.registry import did_you_mean
from mogradient_diffusion.config.settings import ConfigError
from mogradient_diffusion.strategies.amortized import EVERY_STEP, AmortizedSettings, amortizer
from mogradient_diffusion.strategies.base import Strategy

# Harmonizers whose update is a weighted sum yet unfit to train on rewards, and why.
_UNFIT: dict[type[Harmonizer], str] = {
    Krum: "it trains on one reward's gradient per step (Byzantine-robust selection), the "
    "imbalance multi-reward training exists to avoid, and it needs at least 3 rewards",
}


@dataclass(frozen=True)
class HarmonizerSettings(AmortizedSettings):
    options: dict[str, Any] = field(default_factory=dict)  # the harmonizer's own options


def unfit_reason(harmonizer: type[Harmonizer]) -> str | None:
    """Why a harmonizer cannot be a training strategy; None when it can."""
    if not harmonizer.direction_is_weighted_sum:
        return (
            "its update is not a weighted sum of the reward gradients (it works coordinate "
            "by coordinate), so cached weights (and the per-row engine's weights) cannot "
            "apply it"
        )
    return _UNFIT.get(harmonizer)


def _check_option_names(name: str, options: dict[str, Any]) -> None:
    """Each option must be a parameter of the harmonizer's constructor: a misspelt one
    (``cc`` for CAGrad's ``c``) is named, with the closest names and every accepted one."""
    parameters = inspect.signature(HARMONIZERS[name]).parameters.values()
    if any(item.kind is inspect.Parameter.VAR_KEYWORD for item in parameters):
        return  # it takes any keyword: building it is the check
    accepted = [
        item.name
        for item in parameters
        if item.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]
    for option in options:
        if option in accepted:
            continue
        hint = did_you_mean(option, accepted)
        listed = ", ".join(accepted) if accepted else "none"
        raise ConfigError(
            f"strategy.options.{option}: harmonizer {name!r} ({HARMONIZERS[name].__name__}) "
            f"has no option {option!r}{hint}; its options: {listed}"
        )


def trainable_harmonizers() -> list[str]:
    """The names of the core harmonizers a run may train with."""
    return [name for name, cls in HARMONIZERS.items() if unfit_reason(cls) is None]


class HarmonizerStrategy(Strategy):
    settings_type = HarmonizerSettings

    @classmethod
    def check_config(
        cls,
        name: str,
        settings: HarmonizerSettings,
        *,
        reward_names: list[str],
        objective: str,
        objective_settings: Any,
    ) -> None:
        """Build the harmonizer once: its own checks (a quoted ``"false"`` for a bool
        option, an unknown option) then stop the run here, in one line, not after the
        model loads."""
        _check_option_names(name, settings.options)
        try:
            make_harmonizer(name, **settings.options)
        except (TypeError, ValueError) as error:
            raise ConfigError(f"strategy.options of {name!r}: {error}") from None

    @classmethod
    def build(
        cls, name: str, settings: HarmonizerSettings, reward_names: list[str], seed: int
    ) -> Strategy:
        options = dict(settings.options)
        if getattr(HARMONIZERS[name], "randomized", False):
            options.setdefault("seed", seed)
        harmonizer = make_harmonizer(name, **options)
        return cls(name, reward_names, amortizer(harmonizer, settings, EVERY_STEP))
