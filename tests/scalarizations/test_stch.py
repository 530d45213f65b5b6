"""STCH (smooth Tchebycheff): the smoothed weighted max, its gradient against finite
differences, TorchJD on the same inputs, bad settings."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tolerances import reduction_atol

from mogradient.scalarizations import STCH

from .helpers import (
    F64,
    LOSS_SEQUENCE,
    assert_close,
    assert_matches_finite_differences,
    both_gradients,
    loss_gradient,
    softmax,
    torchjd_scalarization,
)


def test_stch_is_the_smoothed_weighted_max() -> None:
    preferences, reference, mu = np.array([0.5, 0.3, 0.2]), np.array([0.1, 0.0, 0.2]), 0.5
    method = STCH(mu=mu, preferences=preferences, reference=reference)
    for values in LOSS_SEQUENCE:
        excess = preferences * (values - reference)
        loss, gradient, weights = loss_gradient(method, values)
        assert_close(loss, mu * np.log(np.sum(np.exp(excess / mu))))
        assert_close(gradient, softmax(excess / mu) * preferences)
        assert_close(weights, gradient)
    # Default preferences are uniform; a tiny mu neither overflows nor loses the max.
    loss, _, weights = loss_gradient(STCH(mu=1e-4), [1e3, 2e3])
    assert math.isclose(loss, 1e3, rel_tol=1e-12)
    assert_close(weights, [0.0, 0.5])


def test_stch_gradient_matches_finite_differences() -> None:
    assert_matches_finite_differences(STCH(mu=0.5, preferences=[0.2, 0.5, 0.3]))


def test_same_as_torchjd_stch() -> None:
    preferences = torch.tensor([0.5, 0.3, 0.2], dtype=F64)
    reference = torch.tensor([0.1, 0.0, 0.2], dtype=F64)
    ours = STCH(mu=0.3, preferences=preferences, reference=reference)
    theirs = torchjd_scalarization().STCH(0.3, weights=preferences, reference=reference)
    for values in LOSS_SEQUENCE:
        our_loss, their_loss, our_grad, their_grad = both_gradients(ours, theirs, values)
        # Same formula in float64, evaluated in another order: the 2K-term sums
        # bound the difference, plus an ulp per exp/log of each term.
        atol = reduction_atol(F64, 2 * len(values), 4 * abs(our_loss) + 4)
        assert abs(our_loss - their_loss) <= atol
        torch.testing.assert_close(our_grad, their_grad, rtol=0, atol=atol)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: STCH(mu=0.0), "mu must be finite and positive"),
        (lambda: STCH(mu=1.0, preferences=[1.0, -1.0]), "non-negative and not all zero"),
        (lambda: STCH(mu=1.0, preferences=[1.0, 1.0], reference=[0.0]), "1 entries"),
    ],
)
def test_bad_settings_are_named(build, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()
