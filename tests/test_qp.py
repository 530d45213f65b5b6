"""The built-in simplex QP against independent solvers and brute-force support enumeration."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest

from mogradient._qp import simplex_kkt_residual, solve_simplex_qp

EXTERNAL_BACKENDS = [
    "cvxpy",
    "qpsolvers:quadprog",
    "qpsolvers:clarabel",
    "qpsolvers:daqp",
    "qpsolvers:proxqp",
    "qpsolvers:osqp",
]
GAP_TOLERANCE = 1e-9


def _random_gram(rng: np.random.Generator, count: int, rank: int, scale: float) -> np.ndarray:
    factor = rng.normal(size=(count, rank))
    return scale * factor @ factor.T


def _adversarial_grams() -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(1234)
    cases = []
    for count in (2, 3, 5, 8, 12, 16):
        cases.append((f"full-rank-K{count}", _random_gram(rng, count, count + 3, 1.0)))
        cases.append((f"rank2-K{count}", _random_gram(rng, count, 2, 1.0)))
        duplicated = rng.normal(size=(count, count + 1))
        duplicated[-1] = duplicated[0]
        cases.append((f"duplicated-K{count}", duplicated @ duplicated.T))
    for scale in (1e-10, 1e-5, 1e5, 1e10):
        cases.append((f"scale{scale:g}-K6", _random_gram(rng, 6, 9, scale)))
        cases.append((f"scale{scale:g}-rank3-K10", _random_gram(rng, 10, 3, scale)))
    conflict = rng.normal(size=(1, 50))
    opposed = np.vstack([conflict, -conflict, 0.5 * conflict + 0.01 * rng.normal(size=(1, 50))])
    cases.append(("opposed-K3", opposed @ opposed.T))
    mixed_scales = rng.normal(size=(5, 20)) * np.array([[1e-4], [1.0], [1e3], [1.0], [10.0]])
    cases.append(("mixed-norms-K5", mixed_scales @ mixed_scales.T))
    return cases


ADVERSARIAL = _adversarial_grams()


def _brute_force(gram: np.ndarray) -> float:
    """Normalized optimum: best feasible affine minimizer over every support (small K)."""
    gram = gram / np.max(np.diag(gram))
    best = np.inf
    count = len(gram)
    for size in range(1, count + 1):
        for support in itertools.combinations(range(count), size):
            sub = gram[np.ix_(support, support)]
            system = np.block([[sub, np.ones((size, 1))], [np.ones((1, size)), np.zeros((1, 1))]])
            rhs = np.zeros(size + 1)
            rhs[-1] = 1.0
            solution = np.linalg.lstsq(system, rhs, rcond=None)[0][:size]
            if np.all(solution >= -1e-12) and abs(solution.sum() - 1) < 1e-9:
                weights = np.clip(solution, 0, None)
                best = min(best, float(weights @ sub @ weights))
    return best


@pytest.mark.parametrize(("name", "gram"), ADVERSARIAL, ids=[name for name, _ in ADVERSARIAL])
def test_builtin_matches_every_backend(name: str, gram: np.ndarray) -> None:
    scale = float(np.max(np.diag(gram)))
    builtin = solve_simplex_qp(gram)
    assert builtin.kkt_residual < 1e-10
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        others = [solve_simplex_qp(gram, backend) for backend in EXTERNAL_BACKENDS]
    best = min([builtin.objective] + [other.objective for other in others])
    assert (builtin.objective - best) / scale <= GAP_TOLERANCE
    unique = np.linalg.eigvalsh(gram / scale).min() > 1e-6
    for other in others:
        assert (other.objective - best) / scale <= GAP_TOLERANCE, other.backend
        difference = builtin.weights - other.weights
        # The min-norm point is unique even when the weights are not.
        assert difference @ gram @ difference / scale <= 1e-8, other.backend
        if unique:
            np.testing.assert_allclose(builtin.weights, other.weights, atol=1e-5)


@pytest.mark.parametrize(("name", "gram"), [case for case in ADVERSARIAL if len(case[1]) <= 8])
def test_builtin_matches_support_enumeration(name: str, gram: np.ndarray) -> None:
    scale = float(np.max(np.diag(gram)))
    assert abs(solve_simplex_qp(gram).objective / scale - _brute_force(gram)) <= GAP_TOLERANCE


def test_two_objective_closed_form() -> None:
    first, second = np.array([1.0, 0.0]), np.array([-0.5, 1.0])
    jacobian = np.vstack([first, second])
    solution = solve_simplex_qp(jacobian @ jacobian.T)
    # Perpendicular foot from the origin onto the segment [first, second].
    edge = first - second
    share = float(np.clip(-(second @ edge) / (edge @ edge), 0, 1))
    np.testing.assert_allclose(solution.weights, [share, 1 - share], atol=1e-15)


@pytest.mark.parametrize("scale", [1e-10, 1.0, 1e10])
def test_weights_do_not_depend_on_overall_scale(scale: float) -> None:
    rng = np.random.default_rng(0)
    gram = _random_gram(rng, 7, 4, 1.0)
    np.testing.assert_allclose(
        solve_simplex_qp(scale * gram).weights, solve_simplex_qp(gram).weights, atol=1e-12
    )


def test_kkt_residual_detects_a_suboptimal_point() -> None:
    gram = np.array([[1.0, -1.0], [-1.0, 4.0]])
    assert simplex_kkt_residual(gram, np.array([0.5, 0.5])) > 0.1
    assert simplex_kkt_residual(gram, solve_simplex_qp(gram).weights) < 1e-12


def test_bad_inputs_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match="square"):
        solve_simplex_qp(np.ones((2, 3)))
    with pytest.raises(ValueError, match="NaN or Inf"):
        solve_simplex_qp(np.array([[1.0, np.nan], [np.nan, 1.0]]))
    with pytest.raises(ValueError, match="unknown QP backend"):
        solve_simplex_qp(np.eye(2), backend="gurobi")


def test_all_zero_gram_gives_uniform_weights() -> None:
    solution = solve_simplex_qp(np.zeros((3, 3)))
    np.testing.assert_allclose(solution.weights, np.full(3, 1 / 3))
    assert solution.objective == 0.0
