"""MGDA (MARBLE's normalize-rescale and plain): published values, conflict, symmetries, options."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from mogradient._qp import solve_simplex_qp
from mogradient.harmonizers import MGDA

from .stacks import TORCHJD_EXAMPLE, finite_floats


@st.composite
def jacobians(draw: st.DrawFn, min_objectives: int = 2, max_objectives: int = 6) -> torch.Tensor:
    count = draw(st.integers(min_objectives, max_objectives))
    dim = draw(st.integers(1, 8))
    values = draw(arrays(np.float64, (count, dim), elements=finite_floats))
    jacobian = torch.from_numpy(values)
    # Keep every row usable: the drop logic is tested separately.
    return jacobian[jacobian.norm(dim=1) > 1e-3] if len(jacobian) else jacobian


def test_plain_mgda_matches_published_direction() -> None:
    result = MGDA(normalize=False)(TORCHJD_EXAMPLE)
    torch.testing.assert_close(
        result.direction, torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64), atol=1e-12, rtol=0
    )
    assert result.kkt_residual < 1e-12


def test_normalize_rescale_formula() -> None:
    norms = TORCHJD_EXAMPLE.norm(dim=1)
    units = TORCHJD_EXAMPLE / norms[:, None]
    alpha = torch.from_numpy(solve_simplex_qp((units @ units.T).numpy(), "cvxpy").weights)
    expected = norms.mean() * (alpha @ units)
    torch.testing.assert_close(MGDA()(TORCHJD_EXAMPLE).direction, expected, atol=1e-7, rtol=1e-7)


@given(jacobians())
def test_mgda_direction_never_conflicts(jacobian: torch.Tensor) -> None:
    if len(jacobian) < 2:
        return
    result = MGDA()(jacobian)
    units = jacobian / jacobian.norm(dim=1, keepdim=True)
    direction = result.direction
    # Below round-off of the gradients' scale the direction is zero (Pareto-stationary).
    if direction.norm() > 1e-10 * jacobian.norm(dim=1).max():
        assert (units @ direction / direction.norm()).min() >= -1e-6


# Found by `make fuzz`: two nearly parallel gradients (cosine 1 - 1e-15) have full
# numerical rank, but their simplex weights are not determined by any float64 Gram.
NEAR_PARALLEL = torch.tensor(
    [[-1.0, 5.9605e-08, 5.9605e-08], [-5.0, 5.9605e-08, 5.9605e-08]], dtype=torch.float64
)


# Found by `make fuzz`: an opposed pair plus a near-parallel one in 2-D (0 is in the hull).
OPPOSED_AND_NEAR_PARALLEL = torch.tensor(
    [[0.0, -8.0], [-9.75, 0.0], [-5.9605e-08, 1.5], [0.0, 1.0]], dtype=torch.float64
)


@given(jacobians(), st.randoms(use_true_random=False))
@example(NEAR_PARALLEL, random.Random(0))
@example(OPPOSED_AND_NEAR_PARALLEL, random.Random(1))
def test_mgda_permutation_permutes_weights(jacobian: torch.Tensor, rng: random.Random) -> None:
    if len(jacobian) < 2:
        return
    order = list(range(len(jacobian)))
    rng.shuffle(order)
    base, permuted = MGDA()(jacobian), MGDA()(jacobian[order])
    # The direction is unique, but a solve exact to round-off r in ||d||^2 pins it down
    # only to ~sqrt(r) ||g||: near-parallel gradients (cos 1 - 1e-15) reach 1e-7 ||g||.
    scale = float(jacobian.norm(dim=1).max())
    torch.testing.assert_close(permuted.direction, base.direction, atol=1e-6 * scale, rtol=1e-6)
    # Weights are unique only when the unit gradients are well conditioned: a singular
    # value s of the unit stack lets the Gram's round-off move them by ~eps / s^2.
    singular = torch.linalg.svdvals(jacobian / jacobian.norm(dim=1, keepdim=True))
    if len(jacobian) <= jacobian.shape[1] and singular.min() > 1e-3 * singular.max():
        torch.testing.assert_close(permuted.weights, base.weights[order], atol=1e-6, rtol=1e-5)


# Found by `make fuzz`: cos 1 - 8e-14, so d's small component is set by round-off.
NEAR_PARALLEL_PAIR = torch.tensor(
    [[0.0, 1.0], [1.17802264144743420365e-06, 3.0]], dtype=torch.float64
)


@given(jacobians(), st.floats(1e-3, 1e3))
@example(NEAR_PARALLEL_PAIR, 17.0)
def test_mgda_scaling(jacobian: torch.Tensor, factor: float) -> None:
    if len(jacobian) < 2:
        return
    # Round-off r in ||d||^2 pins d down to ~sqrt(r) ||g|| (near-parallel gradients).
    floor = 1e-6 * float(jacobian.norm(dim=1).max())
    # Normalize-rescale: direction is homogeneous of degree one in the gradients.
    torch.testing.assert_close(
        MGDA()(factor * jacobian).direction,
        factor * MGDA()(jacobian).direction,
        rtol=1e-6,
        atol=floor * factor,
    )
    # ...and rescaling single objectives only changes the rescale factor m.
    scales = torch.linspace(0.5, 3.0, len(jacobian), dtype=torch.float64)
    scaled = MGDA()(scales[:, None] * jacobian)
    base = MGDA()(jacobian)
    norms = jacobian.norm(dim=1)
    ratio = (scales * norms).mean() / norms.mean()
    torch.testing.assert_close(
        scaled.direction, ratio * base.direction, rtol=1e-5, atol=floor * float(ratio)
    )


def test_mgda_preferences_and_floor() -> None:
    jacobian = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    floored = MGDA(alpha_floor=0.2)(jacobian)
    assert min(floored.extras["alpha"]) >= 0.2 - 1e-12
    tilted = MGDA(preferences=[1.0, 3.0, 1.0])(jacobian)
    plain = MGDA()(jacobian)
    assert tilted.extras["alpha"][1] > plain.extras["alpha"][1]
    with pytest.raises(ValueError, match="infeasible"):
        MGDA(alpha_floor=0.5)(jacobian)
    with pytest.raises(ValueError, match="non-negative"):
        MGDA(preferences=[-1.0, 1.0])
    with pytest.raises(ValueError, match="finite"):
        MGDA(preferences=[float("nan"), 1.0])
    with pytest.raises(ValueError, match="alpha_floor"):
        MGDA(alpha_floor=-0.1)
