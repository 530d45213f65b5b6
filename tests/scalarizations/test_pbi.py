"""PBI (penalty-based boundary intersection): distance along the preference ray plus a
penalty off it, its gradient against finite differences, TorchJD up to its smoothing
constant, bad settings."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tolerances import chain_atol

from mogradient.scalarizations import PBI

from .helpers import (
    F64,
    LOSS_SEQUENCE,
    ULPS,
    assert_close,
    assert_matches_finite_differences,
    both_gradients,
    loss_gradient,
    torchjd_scalarization,
)


def test_pbi_is_distance_along_plus_penalty_off_the_ray() -> None:
    preferences, reference, theta = np.array([1.0, 2.0, 2.0]), np.array([0.0, 0.1, 0.0]), 5.0
    method = PBI(theta=theta, preferences=preferences, reference=reference)
    direction = preferences / 3.0
    for values in LOSS_SEQUENCE:
        excess = values - reference
        along = excess @ direction
        off = excess - along * direction
        loss, gradient, weights = loss_gradient(method, values)
        assert_close(loss, along + theta * np.linalg.norm(off))
        assert_close(gradient, direction + theta * off / np.linalg.norm(off))
        assert_close(weights, gradient)
    assert (weights < 0).any(), "a task ahead of the ray is pushed back: a negative weight"
    # On the ray (always, with one task) the penalty's gradient is its zero subgradient.
    loss, gradient, weights = loss_gradient(PBI(), [0.7])
    assert loss == 0.7 and gradient.tolist() == [1.0] and weights.tolist() == [1.0]


def test_pbi_gradient_matches_finite_differences() -> None:
    assert_matches_finite_differences(PBI(theta=3.0, preferences=[1.0, 1.0, 2.0]))


def test_same_as_torchjd_pbi_up_to_its_smoothing_constant() -> None:
    torchjd = torchjd_scalarization()
    # TorchJD computes d2 as sqrt(|off|^2 + 1e-12) to keep the gradient finite on the ray;
    # ours is |off| exactly. sqrt(d^2 + e) - d <= e / (2 d), so off the ray the losses
    # differ by at most theta * 1e-12 / (2 d2) (plus rounding), and on it by theta * 1e-6.
    theta, smoothing = 5.0, 1e-12
    preferences = torch.tensor([1.0, 2.0, 2.0], dtype=F64)
    ours = PBI(theta=theta, preferences=preferences)
    theirs = torchjd.PBI(theta, weights=preferences)
    for values in LOSS_SEQUENCE:
        our_loss, their_loss, our_grad, their_grad = both_gradients(ours, theirs, values)
        distance = float(ours(torch.tensor(values)).extras["d2"])
        bound = theta * smoothing / (2 * distance) + chain_atol(F64, our_loss, ULPS)
        assert abs(their_loss - our_loss) <= bound
        # The gradients differ by theta * off * (1/d - 1/sqrt(d^2 + e)) <= theta e / (2 d^2).
        bound = theta * smoothing / (2 * distance**2) + chain_atol(F64, theta, ULPS)
        torch.testing.assert_close(our_grad, their_grad, rtol=0, atol=bound)
    single = torch.ones(1, dtype=F64)
    our_loss, their_loss, our_grad, their_grad = both_gradients(
        PBI(theta=theta, preferences=single), torchjd.PBI(theta, single), [0.7]
    )
    assert our_loss == 0.7
    assert math.isclose(their_loss - our_loss, theta * smoothing**0.5, rel_tol=1e-9)
    assert our_grad.tolist() == their_grad.tolist() == [1.0]


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: PBI(theta=-1.0), "theta must be finite and non-negative"),
        (lambda: PBI(2, preferences=[1.0, 1.0, 1.0]), "3 entries but num_tasks is 2"),
    ],
)
def test_bad_settings_are_named(build, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()
