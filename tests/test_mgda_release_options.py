"""MGDA's options from the MARBLE release (issue 36): ``alpha_lower_bound`` (the release's
``alpha_floor``, a bound inside the QP) and ``unit_weights`` (its ``reward_weights``),
against independent solves of the same problems (cvxpy, qpsolvers, support enumeration).

The release (aim-uofa/MARBLE @1bf9543, flow_grpo/pareto_balancer): mgda.py solves
min a^T G a over {sum a = 1, a >= floor} with floor = max(floor, 0), replaced by 1/K when
floor K > 1; balancer.py multiplies the unit gradients by the weights before the solve and
returns (sum_k a_k w_k u_k) times the mean raw norm of the valid gradients.
"""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
import torch

from mogradient._external_qp import TIGHT_QPSOLVERS_OPTIONS
from mogradient._qp import simplex_kkt_residual, solve_simplex_qp, solve_simplex_qp_factored
from mogradient.harmonizers import MGDA

cp = pytest.importorskip("cvxpy")
qpsolvers = pytest.importorskip("qpsolvers")

FRACTIONS = (0.0, 0.3, 0.9, 1 - 1e-6, 1.0)  # floor x K


def _stacks(dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """Random, rank-deficient and near-duplicate stacks, norms spread over ~e^+-2."""
    generator = torch.Generator().manual_seed(7)
    cases = []
    for count in (2, 3, 5, 8):
        sizes = torch.exp(torch.randn(count, 1, generator=generator, dtype=torch.float64))
        full = torch.randn(count, count + 4, generator=generator, dtype=torch.float64)
        low = torch.randn(count, 2, generator=generator, dtype=torch.float64) @ torch.randn(
            2, count + 4, generator=generator, dtype=torch.float64
        )
        near = full.clone()
        near[-1] = near[0] + 1e-9 * torch.randn(count + 4, generator=generator)
        for name, stack in (("random", full), ("rank2", low), ("near-duplicate", near)):
            cases.append((f"{name}-K{count}", (sizes * stack).to(dtype)))
    return cases


def _floored_reference(gram: np.ndarray, floor: float) -> tuple[np.ndarray, float]:
    """min a^T G a over {sum a = 1, a >= floor} in a-space, by cvxpy (Clarabel)."""
    count = len(gram)
    if floor * count >= 1.0 - 1e-12:
        uniform = np.full(count, 1.0 / count)
        return uniform, float(uniform @ gram @ uniform)
    eigenvalues, eigenvectors = np.linalg.eigh(gram)
    factor = (eigenvectors * np.sqrt(np.clip(eigenvalues, 0.0, None))).T
    weights = cp.Variable(count)
    problem = cp.Problem(
        cp.Minimize(cp.sum_squares(factor @ weights)), [weights >= floor, cp.sum(weights) == 1]
    )
    problem.solve(solver=cp.CLARABEL, tol_gap_abs=1e-12, tol_gap_rel=1e-12, tol_feas=1e-12)
    value = np.asarray(weights.value, dtype=np.float64)
    return value, float(value @ gram @ value)


def _floored_qpsolvers(gram: np.ndarray, floor: float, solver: str) -> np.ndarray:
    """The same problem with a box lower bound in qpsolvers (unit-scaled, tiny ridge)."""
    count = len(gram)
    scaled = gram / np.max(np.diag(gram)) + 1e-14 * np.eye(count)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return qpsolvers.solve_qp(
            scaled,
            np.zeros(count),
            A=np.ones((1, count)),
            b=np.ones(1),
            lb=np.full(count, floor),
            solver=solver,
            **TIGHT_QPSOLVERS_OPTIONS.get(solver, {}),
        )


def _feasible(weights: np.ndarray, floor: float) -> np.ndarray:
    """A reference's weights (feasible to its tolerance, ~1e-9) put on {sum a = 1, a >= floor}:
    the excess over the floor clipped at 0 and rescaled."""
    count = len(weights)
    excess = np.clip(weights - floor, 0.0, None)
    if excess.sum() <= 0 or floor * count >= 1.0:
        return np.full(count, 1.0 / count)
    return floor + (1.0 - count * floor) * excess / excess.sum()


def _factored(gram: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    norms = np.sqrt(np.diag(gram))
    return gram / np.outer(norms, norms), norms


def _enumerated(gram: np.ndarray, floor: float) -> float:
    """Best a^T G a over the affine minimizers of every free set (a_k > floor), a >= floor."""
    count = len(gram)
    best = np.inf
    for size in range(1, count + 1):
        for free in itertools.combinations(range(count), size):
            bound = [k for k in range(count) if k not in free]
            system = np.zeros((size + 1, size + 1))
            system[:size, :size] = gram[np.ix_(free, free)]
            system[:size, size] = system[size, :size] = 1.0
            rhs = np.zeros(size + 1)
            rhs[:size] = -floor * gram[np.ix_(free, bound)].sum(axis=1)
            rhs[size] = 1.0 - floor * len(bound)
            solution = np.linalg.lstsq(system, rhs, rcond=None)[0][:size]
            weights = np.full(count, floor)
            weights[list(free)] = solution
            if weights.min() >= floor - 1e-12 and abs(weights.sum() - 1) < 1e-9:
                best = min(best, float(weights @ gram @ weights))
    return best


# -- the QP with a floor ---------------------------------------------------------------


STACKS = _stacks(torch.float64)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("name", "stack"), STACKS, ids=[name for name, _ in STACKS])
def test_floored_qp_matches_cvxpy_and_qpsolvers(name: str, stack: torch.Tensor, dtype) -> None:
    """Grams of float64 stacks and of the same rounded to float32 (then summed in float64):
    no reference (made feasible) beats the optimum by 1e-12 (normalized), the point
    sum_k a_k g_k agrees, the weights too where the Gram is well conditioned, the optimum
    equals support enumeration's to 1e-12, and the certificate is below 1e-10."""
    rounded = stack.to(dtype).to(torch.float64)
    gram = (rounded @ rounded.T).numpy()
    cosines, norms = _factored(gram)
    scale = float(np.max(np.diag(gram)))
    count = len(gram)
    unique = np.linalg.eigvalsh(gram / scale).min() > 1e-6
    for fraction in FRACTIONS:
        floor = fraction / count
        ours = solve_simplex_qp_factored(cosines, norms, floor=floor)
        assert ours.weights.min() >= floor - 1e-15 and abs(ours.weights.sum() - 1) < 1e-14
        assert ours.kkt_residual < 1e-10, (fraction, ours.kkt_residual)
        reference, _ = _floored_reference(gram, floor)
        others = [reference]
        if fraction < 1.0:
            others += [_floored_qpsolvers(gram, floor, s) for s in ("quadprog", "clarabel")]
        for other in map(_feasible, others, [floor] * len(others)):
            value = float(other @ gram @ other)
            assert (ours.objective - value) / scale <= 1e-12, (fraction, ours.objective, value)
            # The point sum_k a_k g_k is unique even where the weights are not.
            difference = ours.weights - other
            assert difference @ gram @ difference / scale <= 1e-8, fraction
            if unique and fraction < 1 - 1e-7:
                np.testing.assert_allclose(ours.weights, other, atol=1e-5)
        if count <= 5 and fraction < 1 - 1e-7:
            assert abs(ours.objective - _enumerated(gram, floor)) / scale <= 1e-12


def test_floor_zero_is_plain_mgda_and_one_over_k_is_uniform() -> None:
    for _, stack in _stacks(torch.float64):
        gram = (stack @ stack.T).numpy()
        cosines, norms = _factored(gram)
        plain = solve_simplex_qp_factored(cosines, norms)
        zero = solve_simplex_qp_factored(cosines, norms, floor=0.0)
        assert np.array_equal(plain.weights, zero.weights)
        assert plain.kkt_residual == zero.kkt_residual
        np.testing.assert_allclose(plain.weights, solve_simplex_qp(gram).weights, atol=1e-12)
        count = len(gram)
        uniform = solve_simplex_qp_factored(cosines, norms, floor=1.0 / count)
        assert np.array_equal(uniform.weights, np.full(count, 1.0 / count))


def test_floored_qp_at_extreme_spreads_and_near_the_uniform_point() -> None:
    """Norms over 1e-6..1e6 and floors up to 1e-12 short of 1/K: feasible and certified
    (the residual is taken on b = (a - f) / (1 - K f), which the solver holds exactly)."""
    rng = np.random.default_rng(3)
    for count in (3, 6):
        gradients = rng.normal(size=(count, count + 2)) * np.logspace(-6, 6, count)[:, None]
        gram = gradients @ gradients.T
        cosines, norms = _factored(gram)
        for fraction in (0.5, 1 - 1e-6, 1 - 1e-12):
            floor = fraction / count
            solution = solve_simplex_qp_factored(cosines, norms, floor=floor)
            assert solution.kkt_residual < 1e-10, (count, fraction, solution.kkt_residual)
            assert solution.weights.min() >= floor


def test_floored_kkt_residual_detects_a_suboptimal_point() -> None:
    gram = np.array([[1.0, -1.0, 0.2], [-1.0, 4.0, 0.5], [0.2, 0.5, 2.0]])
    floor = 0.1
    solution = solve_simplex_qp_factored(*_factored(gram), floor=floor)
    assert simplex_kkt_residual(gram, solution.weights, floor=floor) < 1e-12
    assert simplex_kkt_residual(gram, np.full(3, 1 / 3), floor=floor) > 0.01
    assert simplex_kkt_residual(gram, np.array([0.05, 0.5, 0.45]), floor=floor) >= 0.05
    # The plain problem's optimum violates the floor: not a floored optimum.
    plain = solve_simplex_qp(gram).weights
    assert plain.min() < floor
    assert simplex_kkt_residual(gram, plain, floor=floor) > 0.01


def test_external_backends_take_the_floor_too() -> None:
    rng = np.random.default_rng(0)
    gradients = rng.normal(size=(5, 8))
    gram = gradients @ gradients.T
    cosines, norms = _factored(gram)
    builtin = solve_simplex_qp_factored(cosines, norms, floor=0.1)
    for backend in ("cvxpy", "qpsolvers:clarabel"):
        other = solve_simplex_qp_factored(cosines, norms, backend=backend, floor=0.1)
        np.testing.assert_allclose(other.weights, builtin.weights, atol=1e-6)


def test_a_floor_outside_its_range_is_refused_by_the_solver() -> None:
    cosines, norms = np.eye(3), np.ones(3)
    for floor in (-0.1, 0.5, float("nan")):
        with pytest.raises(ValueError, match="floor must be in"):
            solve_simplex_qp_factored(cosines, norms, floor=floor)


# -- MGDA(alpha_lower_bound=...) ---------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("normalize", [True, False])
def test_mgda_lower_bound_matches_cvxpy(dtype: torch.dtype, normalize: bool) -> None:
    """alpha is the floored QP's solution on the unit (or raw) Gram of the stack as given,
    within the dtype's precision; the direction is the formula's."""
    atol = 1e-6 if dtype == torch.float64 else 2e-3
    gap = 1e-9 if dtype == torch.float64 else 1e-5
    for name, stack in _stacks(dtype):
        exact = stack.to(torch.float64)
        norms = exact.norm(dim=1)
        units = exact / norms[:, None] if normalize else exact
        gram = (units @ units.T).numpy()
        count = len(stack)
        unique = np.linalg.eigvalsh(gram / np.max(np.diag(gram))).min() > 1e-3
        for fraction in (0.3, 0.9):
            floor = fraction / count
            result = MGDA(normalize=normalize, alpha_lower_bound=floor)(stack)
            alpha = np.array(result.extras["alpha"])
            reference, optimum = _floored_reference(gram, floor)
            scale = float(np.max(np.diag(gram)))
            assert (float(alpha @ gram @ alpha) - optimum) / scale <= gap, (name, fraction)
            assert alpha.min() >= floor - 1e-15
            if unique:
                np.testing.assert_allclose(alpha, reference, atol=atol, err_msg=name)
            expected = torch.from_numpy(alpha) @ units
            if normalize:
                expected = norms.mean() * expected
            torch.testing.assert_close(
                result.direction.to(torch.float64),
                expected,
                rtol=0,
                atol=64 * torch.finfo(dtype).eps * float(norms.max()),
            )


def test_mgda_lower_bound_follows_the_release_at_the_edges() -> None:
    stack = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]], dtype=torch.float64)
    plain = MGDA()(stack)
    for bound in (0.0, -0.5):  # the release reads a negative floor as 0
        assert torch.equal(MGDA(alpha_lower_bound=bound)(stack).weights, plain.weights)
    for bound in (1 / 3, 0.5, 7.0):  # floor x K > 1 becomes 1/K: uniform, no error
        result = MGDA(alpha_lower_bound=bound)(stack)
        assert result.extras["alpha"] == [1 / 3] * 3
        assert result.extras["alpha_lower_bound"] == 1 / 3
        norms = stack.norm(dim=1)
        torch.testing.assert_close(result.weights, norms.mean() / 3 / norms)


def test_mgda_lower_bound_counts_the_usable_objectives() -> None:
    """K is the number of valid (usable) gradients, as in the release's solve."""
    stack = torch.tensor([[1.0, 0.0], [0.0, 0.0], [-1.0, 0.5]], dtype=torch.float64)
    result = MGDA(alpha_lower_bound=0.4)(stack)  # 0.4 x 2 <= 1: a floored QP on two
    assert result.dropped == (1,)
    alpha = result.extras["alpha"]
    assert min(alpha) >= 0.4 - 1e-15 and len(alpha) == 2
    uniform = MGDA(alpha_lower_bound=0.6)(stack)  # 0.6 x 2 > 1: 1/2 each
    assert uniform.extras["alpha"] == [0.5, 0.5]
    assert uniform.weights[1] == 0


def test_lower_bound_and_uniform_mix_differ() -> None:
    """Ours (alpha_floor: f + (1 - K f) alpha*) is not the release's bound in the QP."""
    stack = torch.tensor([[1.0, 0.0], [0.6, 0.8], [-1.0, 0.3]], dtype=torch.float64)
    bounded = MGDA(alpha_lower_bound=0.2)(stack).extras["alpha"]
    mixed = MGDA(alpha_floor=0.2)(stack).extras["alpha"]
    assert min(bounded) >= 0.2 - 1e-15 and min(mixed) >= 0.2 - 1e-15
    assert max(abs(b - m) for b, m in zip(bounded, mixed, strict=True)) > 0.04
    # The bound is the better point of the problem both respect.
    units = stack / stack.norm(dim=1, keepdim=True)
    gram = (units @ units.T).numpy()
    assert np.array(bounded) @ gram @ np.array(bounded) < np.array(mixed) @ gram @ np.array(mixed)


def test_mgda_lower_bound_through_an_external_backend() -> None:
    stack = torch.randn(4, 9, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    builtin = MGDA(alpha_lower_bound=0.1)(stack)
    other = MGDA(alpha_lower_bound=0.1, backend="cvxpy")(stack)
    torch.testing.assert_close(other.weights, builtin.weights, atol=1e-6, rtol=0)


# -- MGDA(unit_weights=...) ---------------------------------------------------------------


def _unit_weighted_reference(
    stack: torch.Tensor, unit_weights: np.ndarray, floor: float = 0.0
) -> tuple[np.ndarray, torch.Tensor]:
    """cvxpy on W C W (C the unit Gram of the stack as given, in float64), then the
    release's formula: d = mean raw norm x sum_k alpha_k w_k u_k."""
    exact = stack.to(torch.float64)
    norms = exact.norm(dim=1)
    units = exact / norms[:, None]
    cosines = (units @ units.T).numpy()
    gram = unit_weights[:, None] * cosines * unit_weights[None, :]
    alpha, _ = _floored_reference(gram, floor)
    direction = norms.mean() * (torch.from_numpy(alpha * unit_weights) @ units)
    return alpha, direction


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_unit_weights_match_cvxpy_and_the_formula(dtype: torch.dtype) -> None:
    rng = np.random.default_rng(11)
    atol = 1e-6 if dtype == torch.float64 else 2e-3
    for name, stack in _stacks(dtype):
        count = len(stack)
        unit_weights = np.exp(rng.normal(size=count))
        for floor in (0.0, 0.5 / count):
            result = MGDA(unit_weights=unit_weights.tolist(), alpha_lower_bound=floor)(stack)
            alpha, direction = _unit_weighted_reference(stack, unit_weights, floor)
            ours = np.array(result.extras["alpha"])
            gram = stack.to(torch.float64) / stack.to(torch.float64).norm(dim=1, keepdim=True)
            cosines = (gram @ gram.T).numpy()
            weighted = unit_weights[:, None] * cosines * unit_weights[None, :]
            unique = np.linalg.eigvalsh(weighted / np.max(np.diag(weighted))).min() > 1e-3
            scale = float(np.max(np.diag(weighted)))
            gap = (ours @ weighted @ ours - alpha @ weighted @ alpha) / scale
            assert gap <= (1e-9 if dtype == torch.float64 else 1e-5), (name, floor, gap)
            if unique:
                np.testing.assert_allclose(ours, alpha, atol=atol, err_msg=name)
                torch.testing.assert_close(
                    result.direction.to(torch.float64),
                    direction,
                    rtol=0,
                    atol=10 * atol * float(stack.to(torch.float64).norm(dim=1).max()),
                )
            assert result.kkt_residual < 1e-10
            # The raw weights are m alpha_k w_k / ||g_k||.
            norms = stack.to(torch.float64).norm(dim=1)
            expected = norms.mean() * torch.tensor(ours * unit_weights) / norms
            rtol = 1e-12 if dtype == torch.float64 else 1e-6  # float32 norms: the Gram's
            torch.testing.assert_close(result.weights, expected, rtol=rtol, atol=0)


def test_equal_unit_weights_scale_the_step() -> None:
    """The release scales the unit vectors, so equal weights c scale the direction by c."""
    stack = torch.randn(4, 12, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    plain = MGDA()(stack)
    scaled = MGDA(unit_weights=[2.5] * 4)(stack)
    np.testing.assert_allclose(scaled.extras["alpha"], plain.extras["alpha"], rtol=0, atol=1e-14)
    torch.testing.assert_close(scaled.direction, 2.5 * plain.direction, rtol=1e-12, atol=1e-14)


def test_unit_weights_keep_the_direction_non_conflicting() -> None:
    generator = torch.Generator().manual_seed(9)
    for count in (2, 3, 5, 8):
        for _ in range(5):
            stack = torch.randn(count, 6, generator=generator, dtype=torch.float64)
            stack = stack * torch.exp(2 * torch.randn(count, 1, generator=generator))
            weights = torch.exp(torch.randn(count, generator=generator, dtype=torch.float64))
            result = MGDA(unit_weights=weights)(stack)
            products = stack @ result.direction
            assert (products >= -1e-12 * stack.norm(dim=1) * result.direction.norm()).all()


def test_the_rescale_is_the_mean_raw_norm_of_the_usable_objectives() -> None:
    stack = torch.tensor([[3.0, 0.0], [0.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    result = MGDA(unit_weights=[1.0, 5.0, 2.0])(stack)
    alpha = torch.tensor(result.extras["alpha"], dtype=torch.float64)
    units = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    # mean over the two valid norms (3 and 1), weights 1 and 2 on the valid objectives.
    expected = 2.0 * (alpha * torch.tensor([1.0, 2.0], dtype=torch.float64)) @ units
    torch.testing.assert_close(result.direction, expected, rtol=1e-14, atol=0)
    assert result.weights[1] == 0
    # One valid gradient: the formula at K = 1, v_k g_k (the release returns g_k unweighted).
    single = MGDA(unit_weights=[3.0, 1.0])(torch.tensor([[3.0, 4.0], [0.0, 0.0]]))
    assert single.weights.tolist() == [3.0, 0.0] and single.fallback == "single_objective"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"unit_weights": [1.0, float("nan")]}, "finite positive"),
        ({"unit_weights": [1.0, float("inf")]}, "finite positive"),
        ({"unit_weights": [1.0, 0.0]}, "finite positive"),
        ({"unit_weights": [1.0, -2.0]}, "finite positive"),
        ({"unit_weights": [[1.0, 2.0]]}, "finite positive"),
        ({"unit_weights": []}, "finite positive"),
        ({"unit_weights": ["a", "b"]}, "finite positive"),
        ({"unit_weights": [1.0, 2.0], "normalize": False}, "normalize=True"),
        ({"alpha_lower_bound": float("nan")}, "finite number"),
        ({"alpha_lower_bound": float("inf")}, "finite number"),
        ({"alpha_lower_bound": True}, "finite number"),
        ({"alpha_lower_bound": "0.1"}, "finite number"),
        ({"alpha_lower_bound": 0.1, "alpha_floor": 0.1}, "two floors"),
        ({"alpha_lower_bound": 0.1, "preferences": [1.0, 2.0]}, "unit_weights instead"),
        ({"unit_weights": [1.0, 2.0], "preferences": [1.0, 2.0]}, "unit_weights instead"),
    ],
)
def test_bad_options_raise_one_line_errors(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        MGDA(**options)
    assert "\n" not in str(error.value)


def test_unit_weights_need_one_per_objective() -> None:
    stack = torch.randn(3, 4, dtype=torch.float64)
    for weights in ([1.0, 2.0], [1.0, 2.0, 3.0, 4.0]):
        with pytest.raises(ValueError, match="one per objective"):
            MGDA(unit_weights=weights)(stack)
        with pytest.raises(ValueError, match="one per objective"):
            MGDA(unit_weights=weights)(gram=stack @ stack.T)
    # Called through weigh with objective indices (wrappers such as RewardDropout).
    from mogradient.harmonizers import RewardDropout

    with pytest.raises(ValueError, match="one per objective"):
        RewardDropout(MGDA(unit_weights=[1.0, 2.0]), 0.0, seed=0)(stack)
