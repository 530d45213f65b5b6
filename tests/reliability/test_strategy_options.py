"""Strategy options the chosen strategy does not use are errors; "set" means given."""

from __future__ import annotations

import pytest

from mogradient_diffusion.config.loading import ConfigError, load_config
from mogradient_diffusion.training.strategies import build_strategy


def _amortizer(*overrides: str):
    config = load_config(preset="tiny", overrides=list(overrides))
    return build_strategy(config.strategy, [r.name for r in config.rewards]).amortizer


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
        (["strategy.name=pcgrad", "strategy.options={reduction: mean}"], "strategy.options"),
        (["strategy.name=single", "strategy.reward=color_match", "strategy.period=1"], "period"),
    ],
)
def test_an_option_the_strategy_does_not_use_is_an_error(overrides, unused) -> None:
    with pytest.raises(ConfigError, match=unused):
        load_config(preset="tiny", overrides=overrides)


def test_naming_another_strategy_drops_the_options_of_the_one_it_replaces() -> None:
    # The tiny preset's marble period (2) belongs to marble, not to weighted_sum.
    config = load_config(preset="tiny", overrides=["strategy.name=weighted_sum"])
    assert config.strategy.period is None
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
