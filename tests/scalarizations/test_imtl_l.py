"""IMTL-L (learned loss scales): its formula over SGD steps, its gradient against finite
differences, TorchJD on the same inputs."""

from __future__ import annotations

import numpy as np
import torch
from tolerances import reduction_atol

from mogradient.scalarizations import IMTLL

from .helpers import (
    F64,
    LOSS_SEQUENCE,
    as_losses,
    assert_close,
    assert_matches_finite_differences,
    both_gradients,
    loss_gradient,
    torchjd_scalarization,
)


def test_imtll_matches_its_formula_over_sgd_steps() -> None:
    method = IMTLL(3).double()
    optimizer = torch.optim.SGD(method.parameters(), lr=0.1)
    s = np.zeros(3)
    for values in LOSS_SEQUENCE:
        optimizer.zero_grad()
        loss, gradient, weights = loss_gradient(method, values)
        method(as_losses(values)).loss.backward()
        optimizer.step()
        assert_close(loss, np.sum(np.exp(s) * values - s))
        assert_close(weights, np.exp(s))
        assert_close(gradient, np.exp(s))
        s = s - 0.1 * (np.exp(s) * values - 1.0)
        assert_close(method.log_scales, s)


def test_imtll_gradient_matches_finite_differences() -> None:
    assert_matches_finite_differences(IMTLL(3).double())


def test_same_as_torchjd_imtll() -> None:
    s = torch.tensor([0.2, -0.3, 0.5], dtype=F64)
    ours, theirs = IMTLL(3).double(), torchjd_scalarization().IMTLL(3).double()
    with torch.no_grad():
        ours.log_scales.copy_(s)
        theirs.log_scale.copy_(s)
    for values in LOSS_SEQUENCE:
        our_loss, their_loss, our_grad, their_grad = both_gradients(ours, theirs, values)
        # Same formula in float64, evaluated in another order: the 2K-term sums
        # bound the difference, plus an ulp per exp/log of each term.
        atol = reduction_atol(F64, 2 * len(values), 4 * abs(our_loss) + 4)
        assert abs(our_loss - their_loss) <= atol
        torch.testing.assert_close(our_grad, their_grad, rtol=0, atol=atol)
