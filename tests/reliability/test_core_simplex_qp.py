"""The simplex QP (plain MGDA) at any spread of gradient norms, against exact arithmetic.

The reference is a brute force over supports in rational arithmetic (``fractions``):
the float64 stack is converted exactly, every support's affine minimizer is solved
exactly, and the one meeting the KKT conditions g_k . d >= ||d||^2 (equality on the
support) exactly is the min-norm point. Nothing is rounded, so any tolerance below is
the code's round-off, not the reference's.
"""

from __future__ import annotations

import itertools
from fractions import Fraction

import numpy as np
import pytest
import torch

from mogradient import SolverError, make_harmonizer
from mogradient._qp import simplex_kkt_residual, solve_simplex_qp
from mogradient.harmonizers import MGDA

EPS = float(np.finfo(np.float64).eps)
# Found in the issue: the large third row hid the conflict of d = g_0 with g_1.
ISSUE_STACK = np.array([[1e-5, 0.0, 0.0], [-5.0, 5.0, 0.0], [0.0, 1e6, 1e6]])
# Relative error of d: round-off of the cosines (eps) times the condition of the support's
# unit-scaled system, which stays below ~1e3 for Gaussian directions in D >= K; measured
# worst 1e-14 at 1e-16..1e16.
DIRECTION_TOLERANCE = 1e6 * EPS
# External solvers stop at their own tolerances (1e-12 to 1e-14, set in external_qp);
# measured worst: Clarabel (cvxpy) 7e-11, quadprog 2e-13.
BACKEND_TOLERANCE = {"cvxpy": 1e-9, "qpsolvers:quadprog": 1e-11}


def exact_min_norm_point(jacobian: np.ndarray) -> tuple[list[Fraction], list[list[Fraction]]]:
    """Exact simplex weights of the min-norm point of the rows' hull, and the exact rows."""
    rows = [[Fraction(float(value)) for value in row] for row in jacobian]
    count = len(rows)
    gram = [
        [sum(a * b for a, b in zip(left, right, strict=True)) for right in rows] for left in rows
    ]
    for size in range(1, count + 1):
        for support in itertools.combinations(range(count), size):
            system = [[gram[i][j] for j in support] + [Fraction(1)] for i in support]
            system.append([Fraction(1)] * size + [Fraction(0)])
            solution = solve_exactly(system, [Fraction(0)] * size + [Fraction(1)])
            if solution is None or min(solution[:size]) < 0:
                continue
            weights = [Fraction(0)] * count
            for index, weight in zip(support, solution[:size], strict=True):
                weights[index] = weight
            products = [sum(g * w for g, w in zip(row, weights, strict=True)) for row in gram]
            value = sum(w * p for w, p in zip(weights, products, strict=True))
            if all(product >= value for product in products):
                return weights, rows
    raise AssertionError("no support meets the KKT conditions")


def solve_exactly(matrix: list[list[Fraction]], rhs: list[Fraction]) -> list[Fraction] | None:
    """Gauss-Jordan elimination in rationals; None for a singular matrix."""
    size = len(matrix)
    rows = [[*row, value] for row, value in zip(matrix, rhs, strict=True)]
    for column in range(size):
        pivot = next((r for r in range(column, size) if rows[r][column] != 0), None)
        if pivot is None:
            return None
        rows[column], rows[pivot] = rows[pivot], rows[column]
        for r in range(size):
            if r != column and rows[r][column] != 0:
                factor = rows[r][column] / rows[column][column]
                rows[r] = [a - factor * b for a, b in zip(rows[r], rows[column], strict=True)]
    return [rows[i][size] / rows[i][i] for i in range(size)]


def combine_exactly(weights: list[Fraction], rows: list[list[Fraction]]) -> np.ndarray:
    """d = sum_k w_k g_k, exactly, rounded once to float64."""
    columns = range(len(rows[0]))
    return np.array(
        [float(sum(w * row[t] for w, row in zip(weights, rows, strict=True))) for t in columns]
    )


def worst_exact_slack(rows: list[list[Fraction]], direction: np.ndarray) -> float:
    """min_k (g_k . d - ||d||^2) / (||g_k|| ||d||), computed exactly for the float d."""
    exact = [Fraction(float(value)) for value in direction]
    squared = sum(value * value for value in exact)
    size = float(np.linalg.norm(direction))
    slacks = []
    for row in rows:
        product = sum(g * x for g, x in zip(row, exact, strict=True))
        norm = float(np.linalg.norm([float(value) for value in row]))
        slacks.append(float(product - squared) / (norm * size))
    return min(slacks)


def spread_stacks(exponent: float, count: int) -> list[np.ndarray]:
    """Gaussian directions with log-uniform norms in 10^-e..10^e, K = 2..6, D = K..9."""
    rng = np.random.default_rng(int(exponent))
    stacks = []
    for _ in range(count):
        objectives = int(rng.integers(2, 7))
        dim = int(rng.integers(objectives, 10))
        directions = rng.standard_normal((objectives, dim))
        directions /= np.linalg.norm(directions, axis=1, keepdims=True)
        stacks.append(directions * 10.0 ** rng.uniform(-exponent, exponent, (objectives, 1)))
    return stacks


@pytest.mark.parametrize("exponent", [6.0, 8.0, 16.0])
def test_plain_mgda_is_the_exact_min_norm_point_at_any_spread(exponent: float) -> None:
    for jacobian in spread_stacks(exponent, 25):
        result = make_harmonizer("mgda", normalize=False)(torch.from_numpy(jacobian))
        assert result.dropped == () and result.fallback is None
        weights, rows = exact_min_norm_point(jacobian)
        reference = combine_exactly(weights, rows)
        direction = result.direction.numpy()
        error = np.linalg.norm(direction - reference) / np.linalg.norm(reference)
        assert error <= DIRECTION_TOLERANCE, (error, jacobian)
        # No conflict with any gradient, the smallest included, checked exactly.
        assert worst_exact_slack(rows, direction) >= -DIRECTION_TOLERANCE
        # The certificate is at round-off (K-term products of unit vectors).
        assert result.kkt_residual <= 64 * len(jacobian) * EPS


@pytest.mark.parametrize("backend", sorted(BACKEND_TOLERANCE))
def test_external_backends_solve_the_unit_scaled_problem(backend: str) -> None:
    for jacobian in spread_stacks(8.0, 6):
        weights, rows = exact_min_norm_point(jacobian)
        reference = combine_exactly(weights, rows)
        solved = solve_simplex_qp(jacobian @ jacobian.T, backend).weights @ jacobian
        error = np.linalg.norm(solved - reference) / np.linalg.norm(reference)
        assert error <= BACKEND_TOLERANCE[backend], (backend, error)


def test_issue_stack_gets_the_exact_weights() -> None:
    result = make_harmonizer("mgda", normalize=False)(torch.from_numpy(ISSUE_STACK))
    weights, rows = exact_min_norm_point(ISSUE_STACK)
    assert [float(weight) for weight in weights] == pytest.approx([1 - 1e-6, 1e-6, 0.0], rel=1e-12)
    np.testing.assert_allclose(result.weights.numpy(), [float(w) for w in weights], rtol=1e-9)
    assert worst_exact_slack(rows, result.direction.numpy()) >= -DIRECTION_TOLERANCE


def test_kkt_residual_sees_a_conflict_with_a_small_gradient() -> None:
    """d = g_0 has g_1 . d = -5e-5 < ||d||^2 = 1e-10: cos(g_1, d) = -0.71. Relative to the
    largest Gram entry (2e12) that is 2.5e-17; relative to g_1's own size it is 0.71."""
    gram = ISSUE_STACK @ ISSUE_STACK.T
    assert simplex_kkt_residual(gram, np.array([1.0, 0.0, 0.0])) >= 0.7
    weights, _ = exact_min_norm_point(ISSUE_STACK)
    exact = np.array([float(weight) for weight in weights])
    assert simplex_kkt_residual(gram, exact) <= 64 * 3 * EPS


def test_kkt_residual_bounds_every_conflict() -> None:
    """For any simplex weights, a gradient at cosine c < 0 with d makes the residual at
    least |c| ||g_k|| ||d|| / ((||g_k|| + ||d||) S), S = sum_k a_k ||g_k||: no violation hides
    behind a large gradient."""
    rng = np.random.default_rng(3)
    for jacobian in spread_stacks(8.0, 20):
        weights = rng.dirichlet(np.ones(len(jacobian)))
        direction = weights @ jacobian
        norms = np.linalg.norm(jacobian, axis=1)
        size = float(np.linalg.norm(direction))
        total = float(weights @ norms)
        cosines = jacobian @ direction / (norms * size)
        bound = np.max(-cosines * norms * size / ((norms + size) * total))
        residual = simplex_kkt_residual(jacobian @ jacobian.T, weights)
        assert residual >= bound * (1 - 1e-6)


def test_norms_beyond_float64s_range_are_solved_or_refused_in_one_line() -> None:
    """Norms 1e-160 and 1e160 in one stack: the largest over the smallest overflows.
    Plain MGDA used to fail inside numpy ("SVD did not converge") on such stacks. Where
    the min-norm point leaves the huge gradient out, the answer is exact; where it needs
    it, the raw weight (~1e-320) cannot be represented and the error says what to do."""
    unused = torch.zeros(3, 3, dtype=torch.float64)
    unused[0, 0], unused[1, 1], unused[2] = 1e-160, 1e160, torch.tensor([1.0, -1.0, 1.0])
    result = MGDA(normalize=False)(unused)
    torch.testing.assert_close(result.weights, torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
    needed = torch.tensor([[1e-160, 1e-160], [-1e160, 0.0]], dtype=torch.float64)
    with pytest.raises(SolverError, match="span more than float64's range"):
        MGDA(normalize=False)(needed)
    with pytest.raises(SolverError):  # normalize-rescale's raw weights (~1e320) overflow too
        MGDA()(needed)
