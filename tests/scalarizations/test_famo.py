"""FAMO: its formula and Adam update on the logits written out in numpy, its gradient
against finite differences, TorchJD over updates, misuse and bad settings."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from tolerances import chain_atol

from mogradient.scalarizations import FAMO

from .helpers import (
    F64,
    FD_POINT,
    LOSS_SEQUENCE,
    ULPS,
    assert_close,
    assert_matches_finite_differences,
    both_gradients,
    loss_gradient,
    softmax,
    torchjd_scalarization,
)


class NumpyFAMO:
    """FAMO written out: softmax logits, the log-loss combination, Adam on the logits."""

    def __init__(self, k: int, lr: float, decay: float, bounds: np.ndarray) -> None:
        self.lr, self.decay, self.bounds, self.shift = lr, decay, bounds, 1e-8
        self.w, self.m, self.v, self.t = np.zeros(k), np.zeros(k), np.zeros(k), 0

    def __call__(self, values: np.ndarray) -> tuple[float, np.ndarray]:
        self.before = values
        z, d = softmax(self.w), values - self.bounds + self.shift
        c = 1.0 / np.sum(z / d)
        return c * np.sum(z * np.log(d)), c * z / d

    def update(self, values: np.ndarray) -> None:
        delta = np.log(self.before - self.bounds + self.shift) - np.log(
            values - self.bounds + self.shift
        )
        z = softmax(self.w)
        jacobian = np.diag(z) - np.outer(z, z)  # d softmax / d w
        g = jacobian.T @ delta + self.decay * self.w
        self.t += 1
        self.m = 0.9 * self.m + 0.1 * g
        self.v = 0.999 * self.v + 0.001 * g * g
        m_hat, v_hat = self.m / (1 - 0.9**self.t), self.v / (1 - 0.999**self.t)
        self.w = self.w - self.lr * m_hat / (np.sqrt(v_hat) + 1e-8)


def test_famo_matches_its_formula_over_updates() -> None:
    bounds = np.array([0.1, 0.0, 0.3])
    method = FAMO(3, lr=0.05, weight_decay=1e-3, min_losses=bounds)
    reference = NumpyFAMO(3, 0.05, 1e-3, bounds)
    for before, after in itertools.pairwise(LOSS_SEQUENCE):
        loss, gradient, weights = loss_gradient(method, before)
        expected_loss, expected_weights = reference(before)
        assert_close(loss, expected_loss)
        assert_close(gradient, expected_weights)
        assert_close(weights, expected_weights)
        assert math.isclose(weights.sum(), 1.0, rel_tol=1e-12)  # a convex combination
        method.update(torch.tensor(after, dtype=F64))
        reference.update(after)
        # Adam's step m / sqrt(v) is scale-free: rounding in g moves it by ulps of lr.
        assert_close(method.logits, reference.w)
    assert np.ptp(reference.w) > 0.01  # the weights did move


def test_famo_gradient_matches_finite_differences() -> None:
    method = FAMO(3).double()
    # The normalizer c is a constant in FAMO's backward: differentiate at fixed c.
    method.logits.copy_(torch.tensor([0.3, -0.2, 0.1], dtype=F64))
    c = 1.0 / np.sum(softmax(method.logits.numpy()) / (FD_POINT + 1e-8))

    def function(x: np.ndarray) -> float:
        return c * float(softmax(method.logits.numpy()) @ np.log(x + 1e-8))

    assert_matches_finite_differences(method, function)


def test_same_as_torchjd_famo_over_updates() -> None:
    bounds = torch.tensor([0.1, 0.0, 0.3], dtype=F64)
    ours = FAMO(3, lr=0.05, weight_decay=1e-3, min_losses=bounds)
    theirs = torchjd_scalarization().FAMO(3, min_losses=bounds, lr=0.05, weight_decay=1e-3)
    theirs = theirs.double()
    steps = len(LOSS_SEQUENCE) - 1
    for index in range(steps):
        before, after = LOSS_SEQUENCE[index], LOSS_SEQUENCE[index + 1]
        our_loss, their_loss, our_grad, their_grad = both_gradients(ours, theirs, before)
        atol = chain_atol(F64, max(1.0, abs(our_loss)), ULPS)
        assert abs(our_loss - their_loss) <= atol
        torch.testing.assert_close(our_grad, their_grad, rtol=0, atol=atol)
        ours.update(torch.tensor(after, dtype=F64))
        theirs.update(torch.tensor(after, dtype=F64))
        # Their softmax JVP goes through autograd, ours is closed-form, and torch's Adam
        # updates its first moment with lerp: the gradients differ by ulps (relative) and
        # Adam's scale-free step turns that into ulps of lr per step, accumulated.
        logits_atol = (index + 1) * chain_atol(F64, 0.05, ULPS)
        torch.testing.assert_close(ours.logits, theirs._w.detach(), rtol=0, atol=logits_atol)
    assert ours.logits.abs().max() > 0.05  # the logits moved several steps' worth


def test_update_misuse_and_bad_settings_raise() -> None:
    with pytest.raises(ValueError, match=r"update\(\) needs this step's losses first"):
        FAMO(2).update(torch.ones(2))
    famo = FAMO(2)
    famo(torch.ones(2))
    famo.update(torch.ones(2))
    with pytest.raises(ValueError, match="needs this step's losses first"):
        famo.update(torch.ones(2))  # once per call
    with pytest.raises(ValueError, match="lr"):
        FAMO(2, lr=-1.0)
