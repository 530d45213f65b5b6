"""Tiny gradients are gradients: only exactly-zero or non-finite rows may be dropped.

References are exact: float32 and float64 values converted to rationals, products
summed exactly, rounded once. Squared norms of float32 subnormals (1e-40 -> 1e-80) fit
in float64; those of float64 rows at 1e-160 or 1e-170 do not, which is why the Gram is
kept as row-scaled products beside each row's power of two (``scaled_gram``).
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from mogradient import HARMONIZERS, Amortizer, make_harmonizer
from mogradient._gram import gram_matrix, scaled_gram

from .test_core_simplex_qp import exact_min_norm_point

EPS64 = torch.finfo(torch.float64).eps
EPS32 = torch.finfo(torch.float32).eps
SEEDED = ("grad_vac", "pcgrad", "rlw", "grad_drop")
# Krum and TrimmedMean need at least 3 gradients; the two-row stacks here have 2.
AT_LEAST_THREE = ("krum", "trimmed_mean")
# 2^-560: a float64 row of norm ~1 becomes ~1e-169, whose square is below float64's
# smallest subnormal (5e-324).
TINY = 2.0**-560


def exact_gram(jacobian: torch.Tensor) -> list[list[Fraction]]:
    rows = [[Fraction(float(value)) for value in row] for row in jacobian.double()]
    return [
        [sum(a * b for a, b in zip(left, right, strict=True)) for right in rows] for left in rows
    ]


def build(name: str) -> object:
    return make_harmonizer(name, seed=0) if name in SEEDED else make_harmonizer(name)


def test_gram_of_a_subnormal_float32_row_is_its_square() -> None:
    """1e-40 is a float32 subnormal: its scale 2^132 overflowed float32 and gave NaN."""
    stack = torch.tensor([[0.0, 1e-40]])
    gram = gram_matrix(stack)
    exact = float(exact_gram(stack)[0][0])
    # One float32 product of the exactly rescaled entry: one float32 rounding.
    assert gram[0, 0].item() == pytest.approx(exact, rel=EPS32, abs=0)


def test_float32_subnormals_beside_normal_rows() -> None:
    stack = torch.tensor([[1e-45, 1e-40, 0.0], [3e-39, -2e-41, 1e-44], [1e30, 0.0, 2e29]])
    gram = gram_matrix(stack).numpy()
    exact = exact_gram(stack)
    for i in range(3):
        for j in range(3):
            # Three float32 products of exactly rescaled rows, summed in float64.
            size = float(np.sqrt(float(exact[i][i]) * float(exact[j][j])))
            assert abs(gram[i, j] - float(exact[i][j])) <= 3 * EPS32 * size


@pytest.mark.parametrize("scale", [1e-160, 1e-170, 1e160])
def test_float64_rows_beyond_the_squared_range_keep_exact_products(scale: float) -> None:
    """S 2^(e_i + e_j) is the Gram exactly (to float64 round-off of S), though 2e-320,
    2e-340 or 2e320 cannot be stored as float64."""
    stack = torch.tensor([[1.0, 1.0, 0.0], [0.5, -1.0, 3.0]], dtype=torch.float64) * scale
    scaled, exponents = scaled_gram(stack)
    exact = exact_gram(stack)
    for i in range(2):
        for j in range(2):
            kept = Fraction(scaled[i, j].item()) * Fraction(2) ** int(exponents[i] + exponents[j])
            # |kept - exact| <= 3 eps sqrt(G_ii G_jj), squared to stay in exact arithmetic.
            bound = Fraction(3 * EPS64) ** 2 * exact[i][i] * exact[j][j]
            assert (kept - exact[i][j]) ** 2 <= bound


def test_gram_matrix_rounds_a_1e_160_row_to_its_subnormal_square() -> None:
    stack = torch.full((1, 3), 1e-160, dtype=torch.float64)
    value = gram_matrix(stack)[0, 0].item()
    exact = float(exact_gram(stack)[0][0])  # 3e-320: a subnormal
    assert value > 0 and abs(value - exact) <= 2.0**-1074 + EPS64 * exact


@pytest.mark.parametrize("name", sorted(set(HARMONIZERS) - set(AT_LEAST_THREE)))
def test_no_harmonizer_drops_a_subnormal_float32_row(name: str) -> None:
    result = build(name)(torch.tensor([[1.0, 0.0], [0.0, 1e-40]]))
    assert result.dropped == ()
    assert torch.isfinite(result.weights).all() and torch.isfinite(result.direction).all()


def test_normalize_rescale_mgda_weighs_a_subnormal_row_like_any_other() -> None:
    """Orthogonal unit gradients: alpha = (1/2, 1/2), d = m (u_0 + u_1) / 2 with m the
    mean norm, whatever the second norm."""
    stack = torch.tensor([[1.0, 0.0], [0.0, 1e-40]])
    result = make_harmonizer("mgda")(stack)
    small = float(stack[1, 1])
    mean = (1.0 + small) / 2
    np.testing.assert_allclose(result.extras["alpha"], [0.5, 0.5], rtol=0, atol=EPS64)
    np.testing.assert_allclose(result.weights, [mean / 2, mean / 2 / small], rtol=4 * EPS32)
    np.testing.assert_allclose(result.direction, [mean / 2, mean / 2], rtol=4 * EPS32)


@pytest.mark.parametrize("name", sorted(HARMONIZERS))
def test_a_stack_below_the_squared_range_gives_the_scaled_answer(name: str) -> None:
    """Scaling every gradient by 2^-560 (exact) scales every method's direction by 2^-560,
    Nash-MTL's and FairGrad's (alpha = 1) excepted: G w = 1/w makes their direction
    independent of the gradients' scale."""
    stack = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    # PCD's eps in 1/sqrt(v + eps) is an absolute scale (1e-8 by default); without it
    # the method is scale-free like the others.
    build_here = (lambda name: make_harmonizer(name, eps=0.0)) if name == "pcd" else build
    reference = build_here(name)(stack)
    tiny = build_here(name)(stack * TINY)
    assert tiny.dropped == () and tiny.fallback == reference.fallback
    factor = 1.0 if name in ("nash_mtl", "fair_grad") else TINY
    expected = reference.direction * factor
    # The two paths round the Gram differently (products of rescaled rows): eps-level
    # differences, amplified by at most the cosine matrix's conditioning (here < 10).
    scale = float(expected.norm())
    assert float((tiny.direction - expected).norm()) <= 1e3 * EPS64 * scale


def unit_rows(stack: torch.Tensor) -> torch.Tensor:
    """Rows divided by their norms, taken after dividing by the largest entry: the norm
    of a 1e-160 row itself squares entries below float64's range."""
    peaks = stack.abs().amax(dim=1, keepdim=True)
    scaled = stack / peaks
    return scaled / scaled.norm(dim=1, keepdim=True)


def mixed_stack() -> torch.Tensor:
    """Two unit gradients and one 1e-160 in norm: any direction built from the first two
    alone, (1, 1, 0) d-ish, conflicts with the third."""
    return torch.tensor(
        [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [-1e-160, -2e-161, 1e-160]], dtype=torch.float64
    )


@pytest.mark.parametrize(
    ("name", "options"),
    [("mgda", {}), ("mgda", {"normalize": False}), ("upgrad", {}), ("dual_proj", {})],
    ids=["mgda", "plain-mgda", "upgrad", "dual_proj"],
)
def test_conflict_free_methods_respect_a_gradient_1e160_times_smaller(
    name: str, options: dict
) -> None:
    stack = mixed_stack()
    result = make_harmonizer(name, **options)(stack)
    assert result.dropped == ()
    direction = result.direction.numpy()
    cosines = unit_rows(stack).numpy() @ direction / np.linalg.norm(direction)
    assert cosines.min() >= -64 * EPS64, cosines


def test_normalize_rescale_mgda_solves_the_unit_gradients_problem_exactly() -> None:
    """MGDA() depends on the unit gradients only (then rescales): its alpha is the exact
    min-norm point of the unit rows, the 1e-160 one included."""
    stack = mixed_stack()
    weights, _ = exact_min_norm_point(unit_rows(stack).numpy())
    alpha = make_harmonizer("mgda")(stack).extras["alpha"]
    np.testing.assert_allclose(alpha, [float(w) for w in weights], rtol=0, atol=64 * EPS64)


def test_smoothed_solve_steps_keep_a_gradient_whose_square_underflows() -> None:
    """Row 2 (1e-170) squares below float64's range, so the float64 Gram holds 0 there; it
    is a gradient all the same. Row 3 is exactly zero: dropped, and its weight stays 0."""
    stack = torch.tensor(
        [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1e-170], [0.0, 0.0, 0.0]],
        dtype=torch.float64,
    )
    amortizer = Amortizer(make_harmonizer("mgda"), period=2, smooth_solve_steps=True)
    step = amortizer.full_step(stack)
    assert step.harmonization.dropped == (3,)
    assert step.harmonization.gram[2, 2] == 0  # beyond float64, as stored
    # The first smoothed weights are the solution's: u_0, u_1, u_2 orthogonal, alpha = 1/3.
    torch.testing.assert_close(step.weights, step.harmonization.weights, rtol=0, atol=0)
    assert step.weights[2] > 0 and step.weights[3] == 0
