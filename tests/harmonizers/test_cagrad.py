"""CAGrad against TorchJD and its primal problem."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from mogradient.harmonizers import CAGrad

from .stacks import CROSS_CHECK_SHAPES, random_jacobian

aggregation = pytest.importorskip("torchjd.aggregation")


@pytest.mark.parametrize(("count", "dim", "spread"), CROSS_CHECK_SHAPES)
def test_cagrad_matches_torchjd(count: int, dim: int, spread: float) -> None:
    # Same definition; TorchJD solves the dual with Clarabel at default tolerances, which
    # we measured to be off by up to ~1e-4 relative, so the tolerance here is loose and
    # exact optimality is checked against the primal problem below.
    jacobian = random_jacobian(count * 100 + dim, count, dim, spread)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = aggregation.CAGrad(c=0.5)(jacobian)
    ours = CAGrad()(jacobian)
    torch.testing.assert_close(ours.direction, theirs, atol=1e-3 * theirs.norm(), rtol=0)
    assert ours.kkt_residual < 1e-10


@pytest.mark.parametrize("c", [0.2, 0.5, 0.9, 2.0])
@pytest.mark.parametrize("seed", range(3))
def test_cagrad_solves_the_primal_problem(c: float, seed: int) -> None:
    cp = pytest.importorskip("cvxpy")
    jacobian = random_jacobian(seed, 3 + seed, 8, spread=1.0)
    result = CAGrad(c=c)(jacobian)
    array = jacobian.numpy()
    mean = array.mean(axis=0)
    radius = c * float(np.linalg.norm(mean))
    direction, worst = cp.Variable(array.shape[1]), cp.Variable()
    problem = cp.Problem(
        cp.Maximize(worst), [array @ direction >= worst, cp.norm(direction - mean) <= radius]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "solution may be inaccurate" at these tolerances
        problem.solve(solver=cp.CLARABEL, tol_gap_abs=1e-12, tol_gap_rel=1e-12, tol_feas=1e-12)
    scale = float(jacobian.norm(dim=1).max())
    ours = result.direction.numpy()
    assert np.linalg.norm(ours - mean) <= radius * (1 + 1e-9)
    assert (array @ ours).min() >= problem.value - 1e-8 * scale**2
    np.testing.assert_allclose(ours, direction.value, atol=1e-5 * scale)
    assert result.kkt_residual < 1e-10


def test_cagrad_limits_and_rescale() -> None:
    jacobian = random_jacobian(1, 4, 6)
    torch.testing.assert_close(
        CAGrad(c=0.0)(jacobian).weights, torch.full((4,), 0.25, dtype=torch.float64)
    )
    base, rescaled = CAGrad(c=0.7)(jacobian), CAGrad(c=0.7, rescale=True)(jacobian)
    torch.testing.assert_close(rescaled.weights, base.weights / (1 + 0.7**2))
    # 0 is in the hull and c >= 1: the best worst-case improvement is zero.
    stationary = CAGrad(c=2.0)(torch.tensor([[1.0, 0.0], [-3.0, 0.0]], dtype=torch.float64))
    assert stationary.fallback == "pareto_stationary" and (stationary.weights == 0).all()
