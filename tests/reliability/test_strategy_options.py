"""Strategy options the chosen strategy does not use are errors; "set" means given."""

from __future__ import annotations

import dataclasses
import json

import pytest

from mogradient_diffusion.strategies import build_strategy
from mogradient_diffusion.training_config import ConfigError, load_config


def _amortizer(*overrides: str):
    config = load_config(preset="tiny", overrides=list(overrides))
    names = [r.name for r in config.rewards]
    return build_strategy(config.strategy.name, config.strategy.settings, names).amortizer


def test_a_period_equal_to_the_default_is_still_set() -> None:
    assert _amortizer("strategy.name=pcgrad", "strategy.period=10").period == 10
    assert _amortizer("strategy.name=pcgrad").period == 1  # unset: every step


def test_a_period_alone_does_not_switch_on_smoothing() -> None:
    amortizer = _amortizer("strategy.name=pcgrad", "strategy.period=9")
    assert amortizer.period == 9 and amortizer.ema.rho == 0.0


@pytest.mark.parametrize(
    ("overrides", "unused"),
    [
        (["strategy.name=marble", "strategy.weights=[1, 1]"], "strategy.weights"),
        (["strategy.name=weighted_sum", "strategy.rho=0.7"], "strategy.rho"),
        (["strategy.name=weighted_sum", "strategy.normalize=true"], "strategy.normalize"),
        (["strategy.name=pcgrad", "strategy.weights=[1, 1]"], "strategy.weights"),
        (["strategy.name=single", "strategy.reward=color_match", "strategy.period=1"], "period"),
    ],
)
def test_an_option_the_strategy_does_not_use_is_an_error(overrides, unused) -> None:
    with pytest.raises(ConfigError, match=unused):
        load_config(preset="tiny", overrides=overrides)


def test_naming_another_strategy_drops_the_options_of_the_one_it_replaces() -> None:
    # The tiny preset's marble period (2) belongs to marble, not to weighted_sum.
    config = load_config(preset="tiny", overrides=["strategy.name=weighted_sum"])
    assert dataclasses.asdict(config.strategy.settings) == {"weights": None}
    assert _amortizer("strategy.rho=0.5").period == 2  # marble kept: the preset's period stays


@pytest.mark.parametrize("name", ["trimmedmean", "graddrop", "krum"])
def test_harmonizers_that_cannot_train_on_rewards_are_refused_up_front(name: str) -> None:
    """Their update is not a weighted sum (or picks one reward): named, with the reason."""
    with pytest.raises(ConfigError, match=f"strategy.name='{name}' is not a training strategy"):
        load_config(preset="tiny", overrides=[f"strategy.name={name}"])


def test_config_and_fairgrad_are_strategies_with_their_options() -> None:
    assert type(_amortizer("strategy.name=config").harmonizer).__name__ == "ConFIG"
    fairgrad = _amortizer("strategy.name=fairgrad", "strategy.options={alpha: 2.0}").harmonizer
    assert type(fairgrad).__name__ == "FairGrad" and fairgrad.alpha == 2.0


def test_pcgrad_is_a_harmonizer_strategy_with_its_options_and_the_runs_seed() -> None:
    """Nothing special: a randomized harmonizer is seeded from the run unless told."""
    config = load_config(preset="tiny", overrides=["strategy.name=pcgrad", "run.seed=7"])
    names = [r.name for r in config.rewards]
    pcgrad = build_strategy("pcgrad", config.strategy.settings, names, seed=7)
    assert pcgrad.amortizer.harmonizer.seed == 7
    mean = _amortizer("strategy.name=pcgrad", "strategy.options={reduction: mean}").harmonizer
    assert mean.reduction == "mean"
    with pytest.raises(ConfigError, match=r"strategy\.options\.x: harmonizer 'pcgrad'"):
        load_config(preset="tiny", overrides=["strategy.name=pcgrad", "strategy.options={x: 1}"])


def test_an_unknown_strategy_names_the_closest_choices() -> None:
    with pytest.raises(ConfigError, match=r"unknown strategy 'marbel' \(did you mean 'marble'"):
        load_config(preset="tiny", overrides=["strategy.name=marbel"])


def test_a_saved_config_lists_every_strategys_keys_and_loads_back() -> None:
    """A resume compares saved and current config key by key: the section keeps the keys
    runs were saved with, unset where the strategy does not have them."""
    saved = load_config(preset="tiny").to_dict()["strategy"]
    assert saved["period"] == 2 and saved["weights"] is None and saved["options"] == {}
    again = load_config(preset="tiny", overrides=[f"strategy={json.dumps(saved)}"])
    assert again.to_dict()["strategy"] == saved
