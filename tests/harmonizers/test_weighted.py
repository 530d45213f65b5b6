"""FixedWeights, Mean and RandomWeights."""

from __future__ import annotations

import math

import pytest
import torch

from mogradient.harmonizers import FixedWeights, Mean, RandomWeights


def test_fixed_weights_and_mean() -> None:
    jacobian = torch.randn(3, 5, dtype=torch.float64)
    torch.testing.assert_close(
        FixedWeights([0.5, 0.3, 0.2])(jacobian).direction,
        torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64) @ jacobian,
    )
    torch.testing.assert_close(Mean()(jacobian).direction, jacobian.mean(dim=0))
    jacobian[1] = 0
    rescaled = FixedWeights([0.5, 0.3, 0.2])(jacobian)
    torch.testing.assert_close(
        rescaled.weights, torch.tensor([5 / 7, 0.0, 2 / 7], dtype=torch.float64)
    )
    with pytest.raises(ValueError, match="one weight per objective"):
        FixedWeights([1.0, 1.0])(torch.randn(3, 4))
    signed = torch.randn(3, 4, dtype=torch.float64)
    signed[2] = 0
    # The L1 mass 3.999 is kept: [1, 1] * 3.999 / 2, not a collapse by the signed sum.
    torch.testing.assert_close(
        FixedWeights([1.0, 1.0, -1.999])(signed).weights,
        torch.tensor([1.9995, 1.9995, 0.0], dtype=torch.float64),
    )


def test_random_weights_are_seeded_softmax() -> None:
    jacobian = torch.randn(4, 3)
    first, second = RandomWeights(seed=3)(jacobian), RandomWeights(seed=3)(jacobian)
    torch.testing.assert_close(first.weights, second.weights)
    assert math.isclose(float(first.weights.sum()), 1.0) and (first.weights > 0).all()
