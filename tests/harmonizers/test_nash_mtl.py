"""Nash-MTL against TorchJD and its bargaining equation."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from mogradient.harmonizers import NashMTL

from .stacks import CROSS_CHECK_SHAPES, random_jacobian

aggregation = pytest.importorskip("torchjd.aggregation")


@pytest.mark.parametrize(("count", "dim", "spread"), CROSS_CHECK_SHAPES)
@pytest.mark.parametrize("max_norm", [0.0, 1.0])
def test_nashmtl_matches_torchjd(count: int, dim: int, spread: float, max_norm: float) -> None:
    pytest.importorskip("ecos")  # TorchJD's NashMTL solves with cvxpy + ECOS
    jacobian = random_jacobian(count * 100 + dim, count, dim, spread)
    aggregator = aggregation.NashMTL(n_tasks=count, max_norm=max_norm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = aggregator(jacobian)
    ours = NashMTL(max_norm=max_norm)(jacobian)
    assert ours.kkt_residual < 1e-12
    their_alpha = torch.as_tensor(aggregator.weighting.prvs_alpha, dtype=torch.float64)
    gram = jacobian @ jacobian.T
    their_residual = (gram @ their_alpha - 1 / their_alpha).norm() / (1 / their_alpha).norm()
    if their_residual > 1e-3:
        # TorchJD's ECOS step fails on some inputs (here the square 4 x 4 one) and it
        # silently keeps its initial alpha = 1; there is nothing to compare with.
        return
    # TorchJD stops its convex-concave iterations at ||G a - 1/a|| < 1e-3 (on G/||G||_F).
    torch.testing.assert_close(ours.direction, theirs, atol=1e-4 * theirs.norm(), rtol=0)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("spread", [0.0, 3.0])
def test_nashmtl_solves_bargaining_equation(seed: int, spread: float) -> None:
    count = 3 + seed
    jacobian = random_jacobian(seed, count, 12, spread)
    result = NashMTL(max_norm=0.0)(jacobian)
    alpha = result.weights
    torch.testing.assert_close(
        (jacobian @ result.direction) * alpha,
        torch.ones(count, dtype=torch.float64),
        atol=1e-11,
        rtol=0,
    )
    assert result.kkt_residual < 1e-12 and result.fallback is None
    assert result.direction.norm() == pytest.approx(math.sqrt(count), rel=1e-12)
    clipped = NashMTL()(jacobian)  # default max_norm = 1.0
    assert clipped.direction.norm() == pytest.approx(1.0, rel=1e-12)
    torch.testing.assert_close(clipped.weights, alpha / math.sqrt(count))


def test_nashmtl_duplicate_gradients_still_solvable() -> None:
    # Singular G without a non-negative null vector: the bargaining solution exists.
    jacobian = torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 1.0]], dtype=torch.float64)
    result = NashMTL(max_norm=0.0)(jacobian)
    assert result.fallback is None and result.kkt_residual < 1e-12
    assert result.weights[0] == pytest.approx(float(result.weights[1]), rel=1e-12)


def test_nashmtl_pareto_stationary_gives_zero_weights() -> None:
    jacobian = torch.tensor([[1.0, 0.0], [-3.0, 0.0]], dtype=torch.float64)
    result = NashMTL()(jacobian)
    assert result.fallback == "pareto_stationary"
    assert (result.weights == 0).all() and (result.direction == 0).all()
