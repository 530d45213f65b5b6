"""UW (uncertainty weighting): its formula over SGD steps, its gradient in the losses and
the log-variances, TorchJD and LibMTL on the same inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tolerances import eps, reduction_atol

from mogradient.scalarizations import UW

from .helpers import (
    F64,
    LOSS_SEQUENCE,
    as_losses,
    assert_close,
    both_gradients,
    central_differences,
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


def test_uw_matches_its_formula_over_sgd_steps() -> None:
    method = UW(3, init=0.3).double()
    optimizer = torch.optim.SGD(method.parameters(), lr=0.1)
    s = method.log_variances.detach().numpy().copy()  # 0.3 rounded to float32, then widened
    np.testing.assert_allclose(s, 0.3, rtol=eps(torch.float32))
    for values in LOSS_SEQUENCE:
        optimizer.zero_grad()
        loss, gradient, weights = loss_gradient(method, values)
        method(as_losses(values)).loss.backward()
        optimizer.step()
        assert_close(loss, np.sum(0.5 * np.exp(-s) * values + 0.5 * s))
        assert_close(weights, 0.5 * np.exp(-s))
        assert_close(gradient, 0.5 * np.exp(-s))
        s = s - 0.1 * (-0.5 * np.exp(-s) * values + 0.5)  # d/ds of the loss
        assert_close(method.log_variances, s)


def test_uw_gradient_in_losses_and_log_variances_matches_finite_differences() -> None:
    method = UW(2).double()
    point = np.array([1.4, 0.3, 0.2, -0.5])  # two losses, then two log-variances

    def function(x: np.ndarray) -> float:
        with torch.no_grad():
            method.log_variances.copy_(torch.tensor(x[2:]))
        return float(method(torch.tensor(x[:2], dtype=F64)).loss.detach())

    numeric = central_differences(function, point, 1e-5)
    with torch.no_grad():
        method.log_variances.copy_(torch.tensor(point[2:]))
    losses = as_losses(point[:2])
    loss = method(losses).loss
    analytic = torch.autograd.grad(loss, [losses, method.log_variances])
    atol = 100 * 1e-10 / 6 + 4 * eps(F64) * max(1.0, float(loss.detach())) / 1e-5
    np.testing.assert_allclose(torch.cat(analytic).numpy(), numeric, atol=atol)


def test_same_as_torchjd_uw() -> None:
    s = torch.tensor([0.2, -0.3, 0.5], dtype=F64)
    ours, theirs = UW(3).double(), torchjd_scalarization().UW(3).double()
    with torch.no_grad():
        ours.log_variances.copy_(s)
        theirs.log_var.copy_(s)
    for values in LOSS_SEQUENCE:
        our_loss, their_loss, our_grad, their_grad = both_gradients(ours, theirs, values)
        # Same formula in float64, evaluated in another order: the 2K-term sums
        # bound the difference, plus an ulp per exp/log of each term.
        atol = reduction_atol(F64, 2 * len(values), 4 * abs(our_loss) + 4)
        assert abs(our_loss - their_loss) <= atol
        torch.testing.assert_close(our_grad, their_grad, rtol=0, atol=atol)


@needs_libmtl
@pytest.mark.parametrize("dtype", DTYPES)
def test_uw_matches_libmtl_over_steps(dtype: torch.dtype) -> None:
    # UW starts LibMTL's way here (log-variances -0.5; ours defaults to the paper's 0).
    ours, theirs = Model(dtype), Model(dtype)
    method = UW(TASKS, init=-0.5).to(dtype)
    driver = libmtl("UW", theirs, dtype)
    ours_optimizer = torch.optim.SGD([*ours.parameters(), *method.parameters()], lr=LR)
    their_optimizer = torch.optim.SGD(
        [*theirs.parameters(), *driver._weighting.parameters()], lr=LR
    )
    for step, batch in enumerate(batches(dtype, STEPS)):
        ours_optimizer.zero_grad()
        their_optimizer.zero_grad()
        their_weights = run_libmtl(driver, theirs, theirs.losses(batch))
        result = method(ours.losses(batch))
        result.loss.backward()

        check(result.weights, their_weights, dtype, step, "weights")
        check(flat(ours.shared_parameters()), flat(theirs.shared_parameters()), dtype, step, "W")
        check(heads(ours), heads(theirs), dtype, step, "heads")
        grad = method.log_variances.grad
        check(grad, driver._weighting.loss_scale.grad, dtype, step, "log-variances")
        ours_optimizer.step()
        their_optimizer.step()
