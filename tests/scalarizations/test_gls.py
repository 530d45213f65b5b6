"""GLS (the geometric mean of the losses): its formula, its gradient against finite
differences, TorchJD and LibMTL on the same inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tolerances import reduction_atol

from mogradient.scalarizations import GLS

from .helpers import (
    F64,
    LOSS_SEQUENCE,
    assert_close,
    assert_matches_finite_differences,
    both_gradients,
    loss_gradient,
    torchjd_scalarization,
)
from .libmtl import (
    DTYPES,
    LR,
    STEPS,
    TASKS,
    Model,
    batches,
    check,
    flat,
    heads,
    libmtl,
    needs_libmtl,
    run_libmtl,
)


def test_gls_is_the_geometric_mean() -> None:
    method = GLS()
    for values in LOSS_SEQUENCE:
        loss, gradient, weights = loss_gradient(method, values)
        mean = np.prod(values) ** (1 / 3)
        assert_close(loss, mean)
        assert_close(gradient, mean / (3 * values))
        assert_close(weights, gradient)


def test_gls_gradient_matches_finite_differences() -> None:
    assert_matches_finite_differences(GLS())


def test_same_as_torchjd_gls() -> None:
    ours, theirs = GLS(), torchjd_scalarization().GeometricMean()
    for values in LOSS_SEQUENCE:
        our_loss, their_loss, our_grad, their_grad = both_gradients(ours, theirs, values)
        # Same formula in float64, evaluated in another order: the 2K-term sums
        # bound the difference, plus an ulp per exp/log of each term.
        atol = reduction_atol(F64, 2 * len(values), 4 * abs(our_loss) + 4)
        assert abs(our_loss - their_loss) <= atol
        torch.testing.assert_close(our_grad, their_grad, rtol=0, atol=atol)


@needs_libmtl
@pytest.mark.parametrize("dtype", DTYPES)
def test_gls_has_libmtls_gradients_and_reports_the_derivative(dtype: torch.dtype) -> None:
    # The same gradients. LibMTL reports L_k / (K prod_j L_j) as its weights, which is not
    # d loss / d L_k; ours reports that derivative, G / (K L_k) with G the geometric mean.
    ours, theirs = Model(dtype), Model(dtype)
    method = GLS(TASKS)
    driver = libmtl("GLS", theirs, dtype)
    ours_optimizer = torch.optim.SGD(ours.parameters(), lr=LR)
    their_optimizer = torch.optim.SGD(theirs.parameters(), lr=LR)
    for step, batch in enumerate(batches(dtype, STEPS)):
        ours_optimizer.zero_grad()
        their_optimizer.zero_grad()
        their_losses = theirs.losses(batch)
        their_weights = run_libmtl(driver, theirs, their_losses)
        losses = ours.losses(batch)
        result = method(losses)
        result.loss.backward()

        check(flat(ours.shared_parameters()), flat(theirs.shared_parameters()), dtype, step, "W")
        check(heads(ours), heads(theirs), dtype, step, "heads")
        values = losses.detach().double()
        mean = values.prod() ** (1 / TASKS)
        # Scaled by the sum of the weights: the two reports' values are ~1e-4 and ~1e-1.
        expected = mean / (TASKS * values)
        check(result.weights / expected.sum(), expected / expected.sum(), dtype, step, "ours")
        theirs_expected = values / (TASKS * values.prod())
        check(
            their_weights / theirs_expected.sum(),
            theirs_expected / theirs_expected.sum(),
            dtype,
            step,
            "LibMTL's",
        )
        ours_optimizer.step()
        their_optimizer.step()
