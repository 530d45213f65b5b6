"""FairGrad against its system of equations and TorchJD."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.optimize
import torch

from mogradient.harmonizers import (
    FairGrad,
)

from .stacks import STRESS, STRESS_IDS, float32_bound, parity_stacks, random_stack, relative

aggregation = pytest.importorskip("torchjd.aggregation")


ALPHAS = (0.5, 1.0, 2.0)


def fairgrad_reference(stack: np.ndarray, alpha: float) -> np.ndarray:
    """G w = w^(-1/alpha), w > 0, solved by scipy in x = log w on the relative residual
    (G w)_k w_k^(1/alpha) - 1, from the orthogonal-gradients guess."""
    gram = stack @ stack.T

    def residual(log_weights: np.ndarray) -> np.ndarray:
        weights = np.exp(log_weights)
        return (gram @ weights) * weights ** (1.0 / alpha) - 1.0

    start = -alpha / (alpha + 1.0) * np.log(np.diag(gram))
    solution = scipy.optimize.least_squares(residual, start, xtol=1e-15, ftol=1e-15, gtol=1e-15)
    assert np.abs(solution.fun).max() <= 1e-12
    return np.exp(solution.x)


def system_residual(stack: np.ndarray, weights: np.ndarray, alpha: float) -> float:
    """max_k |(G w)_k - w_k^(-1/alpha)| / (w_k^(-1/alpha) + (|G| w)_k), G from the stack."""
    gram = stack @ stack.T
    demand = weights ** (-1.0 / alpha)
    return float(np.max(np.abs(gram @ weights - demand) / (demand + np.abs(gram) @ weights)))


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("stack", parity_stacks(), ids=lambda s: f"K{len(s)}D{s.shape[1]}")
def test_fairgrad_matches_its_system_and_torchjd(stack: torch.Tensor, alpha: float) -> None:
    result = FairGrad(alpha)(stack)
    assert result.fallback is None and result.kkt_residual <= 1e-12
    np.testing.assert_allclose(
        result.weights.numpy(), fairgrad_reference(stack.numpy(), alpha), rtol=1e-10
    )
    # TorchJD's scipy least_squares stops at a relative step of xtol = 1e-8.
    assert relative(result.direction, aggregation.FairGrad(alpha)(stack)) <= 1e-8
    single = stack.float()
    theirs = aggregation.FairGrad(alpha)(single)
    assert relative(FairGrad(alpha)(single).direction, theirs) <= float32_bound(single.double(), 2)
    torch.testing.assert_close(
        FairGrad(alpha)(gram=stack @ stack.T).weights, result.weights, rtol=1e-10, atol=0
    )


def test_fairgrad_alpha_zero_is_the_mean_as_in_torchjd() -> None:
    stack = random_stack(3, 4, 12)
    result = FairGrad(0.0)(stack)
    torch.testing.assert_close(result.direction, stack.mean(dim=0))
    torch.testing.assert_close(result.direction, aggregation.FairGrad(0.0)(stack))


def hull_min_norm_squared(stack: np.ndarray) -> float:
    """min over the simplex of ||sum_k a_k u_k||^2, by scipy's NNLS with a heavy sum-to-one row."""
    units = stack / np.linalg.norm(stack, axis=1, keepdims=True)
    heavy = 1e4
    system = np.vstack([units.T, heavy * np.ones(len(stack))])
    target = np.concatenate([np.zeros(stack.shape[1]), [heavy]])
    alpha, _ = scipy.optimize.nnls(system, target)
    alpha /= alpha.sum()
    return float(np.sum((alpha @ units) ** 2))


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize(("name", "stack"), STRESS, ids=STRESS_IDS)
def test_fairgrad_stress(name: str, stack: torch.Tensor, alpha: float) -> None:
    """Finite everywhere. Guarantee: g_k . d = w_k^(-1/alpha) > 0 for every k whenever the
    system has a solution, i.e. unless zero is in the gradients' convex hull; there the
    weights are zero (``pareto_stationary``), which the hull's min-norm on the stack
    confirms (below the float64 Gram's round-off, 4 K eps, up to NNLS's own accuracy)."""
    result = FairGrad(alpha)(stack)
    assert torch.isfinite(result.weights).all() and torch.isfinite(result.direction).all()
    values = stack.numpy()
    if result.fallback == "pareto_stationary":
        assert not result.weights.any()
        assert hull_min_norm_squared(values) <= 1e3 * len(values) * np.finfo(float).eps
        return
    assert result.fallback is None and (result.weights > 0).all()
    assert system_residual(values, result.weights.numpy(), alpha) <= 1e-10
    # On the stack, up to the rounding of d = sum_k w_k g_k (huge cancelling weights on a
    # near-opposed pair leave g_k . d = w_k^(-1/alpha) below it).
    norms = stack.norm(dim=1)
    rounding = 4 * len(stack) * 2.0**-53 * norms * float(result.weights.abs() @ norms)
    assert (stack @ result.direction > -rounding).all()
