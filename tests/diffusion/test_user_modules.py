"""A config's user modules (``reward_modules``) are imported before any section is read, so
they can register a strategy, an objective or a model family, not only rewards."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from mogradient_diffusion.config.settings import ConfigError
from mogradient_diffusion.training_config import load_config

MODULE = """
from dataclasses import dataclass

from mogradient.amortize import Amortizer
from mogradient.harmonizers import MGDA
from mogradient_diffusion.strategies import STRATEGIES, Strategy


@dataclass(frozen=True)
class Settings:
    period: int = 2


@STRATEGIES.register("user_module_strategy")
class UserStrategy(Strategy):
    settings_type = Settings

    @classmethod
    def build(cls, name, settings, reward_names, seed):
        return cls(name, reward_names, Amortizer(MGDA(), period=settings.period, rho=0.0))
"""


def test_a_strategy_registered_in_a_user_module_is_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "user_strategies_module.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config(
        preset="tiny",
        overrides=[
            "reward_modules=[user_strategies_module]",
            "strategy.name=user_module_strategy",
            "strategy.period=5",
        ],
    )
    assert config.strategy.name == "user_module_strategy"
    assert config.strategy.settings.period == 5


def test_a_module_python_cannot_find_says_how_to_make_it_importable() -> None:
    with pytest.raises(
        ConfigError, match=r"cannot import 'my_missing_rewards'.*folder you run from"
    ):
        load_config(preset="tiny", overrides=["reward_modules=[my_missing_rewards]"])
