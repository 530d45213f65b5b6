"""RewardDropout: rate, warmup and renormalization."""

from __future__ import annotations

import math

import torch

from mogradient.harmonizers import FixedWeights, Mean, RewardDropout


def test_reward_dropout_rate_warmup_and_renormalization() -> None:
    jacobian = torch.randn(4, 6, dtype=torch.float64)
    dropout = RewardDropout(
        FixedWeights([1.0, 1.0, 1.0, 1.0]), probability=0.5, seed=0, droppable=[1, 2, 3]
    )
    drops = torch.zeros(4)
    for _ in range(2000):
        result = dropout(jacobian)
        for index in result.dropped:
            drops[index] += 1
        assert math.isclose(float(result.weights.sum()), 4.0)
    assert drops[0] == 0
    assert torch.allclose(drops[1:] / 2000, torch.full((3,), 0.5), atol=0.05)
    warm = RewardDropout(Mean(), probability=0.8, warmup_steps=10, seed=0)
    assert warm.current_probability() == 0.0
    for _ in range(5):
        warm(jacobian)
    assert math.isclose(warm.current_probability(), 0.4)
    always = RewardDropout(Mean(), probability=1.0, seed=0)
    assert (always(jacobian).weights > 0).sum() == 1
