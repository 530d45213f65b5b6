"""Exactness on the stacks that break naive solvers: wide norm spreads and near-singular Grams.

Every reference here is independent of the code under test: the d-space definitions
of UPGrad and DualProj solved on the stack itself by quadprog (cvxpy/Clarabel as the
fallback), CAGrad by a 100-digit brute force over supports, PCGrad by its projections
on the vectors, and the Frank-Wolfe gap, a solver-free certificate of optimality for
MGDA's simplex QP.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from mogradient import make_harmonizer
from mogradient._qp import solve_simplex_qp

cp = pytest.importorskip("cvxpy")
qpsolvers = pytest.importorskip("qpsolvers")

TIGHT = {"tol_gap_abs": 1e-13, "tol_gap_rel": 1e-13, "tol_feas": 1e-13, "max_iter": 400}
NEAR_SINGULAR_KINDS = ("opposed_pair", "near_duplicates", "rank_deficient")


def spread_stack(seed: int, count: int, dim: int, exponents: tuple[float, float]) -> torch.Tensor:
    """Gaussian directions with norms 10^e, e evenly spread over ``exponents``, rows shuffled."""
    rng = np.random.default_rng(seed)
    directions = rng.standard_normal((count, dim))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    norms = 10.0 ** np.linspace(*exponents, count)
    return torch.from_numpy(directions * rng.permutation(norms)[:, None])


def near_singular_stack(
    kind: str, seed: int, count: int, dim: int = 6, noise: float = 1e-7
) -> torch.Tensor:
    """An opposed pair (g, -c g + noise), near-duplicates, or a rank-2 stack."""
    rng = np.random.default_rng(seed)
    stack = rng.standard_normal((count, dim))
    if kind == "opposed_pair":
        stack[1] = -rng.uniform(0.3, 3.0) * stack[0] + noise * rng.standard_normal(dim)
    elif kind == "near_duplicates":
        for index in range(1, count, 2):
            stack[index] = stack[index - 1] + noise * rng.standard_normal(dim)
    elif kind == "rank_deficient":
        stack = rng.standard_normal((count, 2)) @ rng.standard_normal((2, dim))
    return torch.from_numpy(stack)


def unit_rows(jacobian: np.ndarray) -> np.ndarray:
    return jacobian / np.linalg.norm(jacobian, axis=1, keepdims=True)


def dual_cone_projection(jacobian: np.ndarray, point: np.ndarray) -> np.ndarray:
    """argmin ||d - point|| subject to J d >= 0, in d-space (rows normalized: same cone).

    quadprog's dual active set (Goldfarb-Idnani) solves this strictly convex QP exactly;
    cvxpy/Clarabel is the fallback. Clarabel alone is not precise enough here: on 16
    near-duplicate normals in 6-D it stops 8e-5 away, or gives up.
    """
    size = float(np.linalg.norm(point))
    if size == 0.0:
        return np.zeros_like(point)
    solution = qpsolvers.solve_ls(
        np.eye(len(point)),
        point / size,
        G=-unit_rows(jacobian),
        h=np.zeros(len(jacobian)),
        solver="quadprog",
    )
    if solution is not None:
        return size * solution
    direction = cp.Variable(len(point))
    problem = cp.Problem(
        cp.Minimize(cp.sum_squares(direction - point / size)),
        [unit_rows(jacobian) @ direction >= 0],
    )
    problem.solve(solver=cp.CLARABEL, **TIGHT)
    return np.asarray(direction.value) * size


def upgrad_reference(jacobian: np.ndarray) -> np.ndarray:
    count = len(jacobian)
    return sum(dual_cone_projection(jacobian, row / count) for row in jacobian)


def dualproj_reference(jacobian: np.ndarray) -> np.ndarray:
    return dual_cone_projection(jacobian, jacobian.mean(axis=0))


def cagrad_reference(jacobian: np.ndarray, c: float = 0.5, digits: int = 100) -> np.ndarray:
    """CAGrad's direction from its optimality conditions, in 100-digit arithmetic (mpmath).

    Clarabel's tolerances are absolute, so it cannot see the part of a 1e-16..1e16 stack
    that lives at 1e-32 of the largest Gram entry; this brute force over supports can.
    On the affine hull of a support S, the stationary points of the dual
    min_w g_w.g0 + s||g_w|| (s = c||g0||) solve G_SS w + nu 1 = -lam G_S g0 with
    lam = ||g_w|| / s: w is affine in lam and ||g_w(lam)||^2 = s^2 lam^2 is a quadratic.
    A candidate is kept when w >= 0 and d = g0 + g_w / lam meets the primal optimality
    conditions g_k.d >= mu for all k, with equality on S; these suffice (convex problem),
    some affinely independent support attains the optimum (Caratheodory), and d is unique.
    """
    mp = pytest.importorskip("mpmath")
    with mp.workdps(digits):
        rows = [[mp.mpf(float(value)) for value in row] for row in jacobian]
        count = len(rows)

        def dot(left: list, right: list) -> object:
            return mp.fsum(a * b for a, b in zip(left, right, strict=True))

        def combine(weights: list, indices: tuple[int, ...]) -> list:
            return [
                mp.fsum(w * rows[k][t] for w, k in zip(weights, indices, strict=True))
                for t in range(len(rows[0]))
            ]

        mean = combine([mp.mpf(1) / count] * count, tuple(range(count)))
        radius = c * mp.sqrt(dot(mean, mean))
        norms = [mp.sqrt(dot(row, row)) for row in rows]
        tolerance = mp.mpf(10) ** (-digits // 2)
        found = []
        for size in range(1, count + 1):
            for support in itertools.combinations(range(count), size):
                system = mp.matrix(size + 1, size + 1)
                for i, a in enumerate(support):
                    for j, b in enumerate(support):
                        system[i, j] = dot(rows[a], rows[b])
                    system[i, size] = system[size, i] = 1
                try:
                    inverse = system**-1
                except ZeroDivisionError:
                    continue  # affinely dependent support
                linear = [dot(rows[k], mean) for k in support]
                base = [inverse[i, size] for i in range(size)]
                slope = [
                    -mp.fsum(inverse[i, j] * linear[j] for j in range(size)) for i in range(size)
                ]
                at_base, along = combine(base, support), combine(slope, support)
                # ||at_base + lam along||^2 = radius^2 lam^2
                quadratic = dot(along, along) - radius**2
                half_linear, constant = dot(at_base, along), dot(at_base, at_base)
                discriminant = half_linear**2 - quadratic * constant
                if quadratic == 0 or discriminant < 0:
                    continue
                for sign in (1, -1):
                    shift = (-half_linear + sign * mp.sqrt(discriminant)) / quadratic
                    weights = [b + shift * v for b, v in zip(base, slope, strict=True)]
                    if not shift > 0 or min(weights) < -tolerance:
                        continue
                    combined = combine(weights, support)
                    direction = [m + g / shift for m, g in zip(mean, combined, strict=True)]
                    size_d = mp.sqrt(dot(direction, direction))
                    products = [dot(row, direction) for row in rows]
                    level = products[min(support, key=lambda k: norms[k])]
                    slack = [(products[k] - level) / (norms[k] * size_d) for k in range(count)]
                    if (
                        min(slack) >= -tolerance
                        and max(abs(slack[k]) for k in support) <= tolerance
                    ):
                        found.append(np.array([float(value) for value in direction]))
        assert found, "no KKT point (is 0 in the hull with c >= 1?)"
        scale = float(max(norms))
        assert all(np.linalg.norm(other - found[0]) <= 1e-12 * scale for other in found)
        return found[0]


def frank_wolfe_gap(cosines: np.ndarray, alpha: np.ndarray) -> float:
    """2 (a^T C a - min_k (C a)_k) >= f(a) - f*: a solver-free optimality certificate."""
    products = cosines @ alpha
    return 2.0 * float(alpha @ products - products.min())


# --- MGDA normalize-rescale at any spread --------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "exponents"),
    [(torch.float64, (-16.0, 16.0)), (torch.float32, (-36.0, 36.0))],
    ids=["float64-1e-16..1e16", "float32-1e-36..1e36"],
)
@pytest.mark.parametrize("count", [2, 3, 5, 8, 16])
def test_mgda_normalize_is_exact_at_any_spread(
    dtype: torch.dtype, exponents: tuple[float, float], count: int
) -> None:
    for seed in range(3):
        jacobian = spread_stack(seed, count, 12, exponents).to(dtype)
        assert torch.isfinite(jacobian).all() and (jacobian.double().norm(dim=1) > 0).all()
        result = make_harmonizer("mgda")(jacobian)
        assert result.dropped == () and result.fallback is None
        stored = jacobian.double().numpy()  # the values the harmonizer saw, exactly
        cosines = unit_rows(stored) @ unit_rows(stored).T
        alpha = np.asarray(result.extras["alpha"])
        if dtype == torch.float64:
            assert frank_wolfe_gap(cosines, alpha) <= 1e-9
        # A float32 Gram carries ~1e-7 relative error: the solution is optimal for it, and
        # the optimality gap on the exact cosines is second order in that error.
        best = solve_simplex_qp(cosines, backend="cvxpy").weights
        assert alpha @ cosines @ alpha - best @ cosines @ best <= 1e-9
        assert torch.isfinite(result.direction).all()
        # The direction is m * sum alpha_k u_k, m the mean raw norm: finite and of that size.
        mean_norm = float(np.linalg.norm(stored, axis=1).mean())
        expected = mean_norm * float(np.sqrt(max(alpha @ cosines @ alpha, 0.0)))
        assert float(result.direction.double().norm()) == pytest.approx(expected, rel=1e-4)


def test_plain_mgda_leans_on_the_smallest_gradient() -> None:
    """Plain MGDA is scale-dependent by definition: the min-norm point sits near the
    smallest gradient, so the update is about that small. Nothing is dropped."""
    jacobian = spread_stack(0, 4, 8, (-12.0, 12.0))
    result = make_harmonizer("mgda", normalize=False)(jacobian)
    smallest = int(jacobian.norm(dim=1).argmin())
    assert result.dropped == ()
    assert result.weights[smallest] == pytest.approx(1.0, abs=1e-9)
    assert float(result.direction.norm()) <= 1.01 * float(jacobian.norm(dim=1).min())


# --- UPGrad and DualProj against their d-space definitions ---------------------------
# A float64 Gram resolves a gradient's component off a near-dependent one only to
# ~sqrt(eps) of its norm (1e-7 noise: ||noise||^2 = 1e-14 is known to ~1%), so on such
# stacks the harmonizers redo the projection on the stack itself (refine=True, default);
# the Gram-only solve is checked where the Gram does resolve it.


def forming_round_off(result: object, jacobian: torch.Tensor) -> float:
    """Round-off of forming d = sum_k w_k g_k, relative to max ||g||: 64 eps sum |w_k| ||g_k||."""
    norms = jacobian.norm(dim=1)
    eps = torch.finfo(torch.float64).eps
    return 64 * eps * float(result.weights.abs() @ norms) / float(norms.max())


def check_against_definition(name: str, jacobian: torch.Tensor, **options: object) -> object:
    """Direction within 1e-6 max||g|| of the d-space definition; returns the result."""
    reference_of = upgrad_reference if name == "upgrad" else dualproj_reference
    result = make_harmonizer(name, **options)(jacobian)  # must never raise
    scale = float(jacobian.norm(dim=1).max())
    reference = reference_of(jacobian.numpy())
    assert np.linalg.norm(result.direction.numpy() - reference) <= 1e-6 * scale
    return result


@pytest.mark.parametrize("kind", NEAR_SINGULAR_KINDS)
@pytest.mark.parametrize("count", [2, 3, 5, 8, 16])
@pytest.mark.parametrize("noise", [1e-4, 1e-7])
@pytest.mark.parametrize("name", ["upgrad", "dual_proj"])
def test_dual_cone_methods_match_definition_on_near_singular_stacks(
    name: str, noise: float, kind: str, count: int
) -> None:
    for seed in range(2):
        jacobian = near_singular_stack(kind, seed, count, noise=noise)
        result = check_against_definition(name, jacobian)
        scale = float(jacobian.norm(dim=1).max())
        assert float((jacobian @ result.direction).min()) >= -1e-12 * scale**2
        assert result.kkt_residual < 1e-9


@pytest.mark.parametrize("kind", NEAR_SINGULAR_KINDS)
@pytest.mark.parametrize("count", [2, 3, 5, 8])
@pytest.mark.parametrize("name", ["upgrad", "dual_proj"])
def test_gram_only_solve_is_exact_where_the_gram_resolves_it(
    kind: str, count: int, name: str
) -> None:
    """refine=False: 1e-4 noise is resolved by the Gram; conflicts stay within 1e-12 or the
    round-off of forming d from (then large, ~1/noise) weights."""
    for seed in range(2):
        jacobian = near_singular_stack(kind, seed, count, noise=1e-4)
        result = check_against_definition(name, jacobian, refine=False)
        allowed = max(forming_round_off(result, jacobian), 1e-12)
        scale = float(jacobian.norm(dim=1).max())
        assert float((jacobian @ result.direction).min()) >= -allowed * scale**2
        assert result.kkt_residual < max(1e-9, allowed)


@pytest.mark.parametrize("name", ["upgrad", "dual_proj"])
@pytest.mark.parametrize("count", [3, 5, 8])
def test_dual_cone_methods_at_wide_spread(name: str, count: int) -> None:
    reference_of = upgrad_reference if name == "upgrad" else dualproj_reference
    for seed in range(3):
        jacobian = spread_stack(seed, count, 10, (-8.0, 8.0))
        result = make_harmonizer(name)(jacobian)
        assert result.dropped == ()
        direction = result.direction.numpy()
        reference = reference_of(jacobian.numpy())
        scale = float(jacobian.norm(dim=1).max())
        assert np.linalg.norm(direction - reference) <= 1e-6 * scale
        # No conflict even with the smallest gradient: cosines, not raw products.
        size = max(float(np.linalg.norm(direction)), 1e-300)
        assert float((unit_rows(jacobian.numpy()) @ direction).min()) >= -1e-10 * size


# --- every other Gram-based harmonizer ------------------------------------------------

OTHER_METHODS = ("cagrad", "nash_mtl", "imtl_g", "aligned_mtl", "grad_vac", "pcgrad", "mean", "rlw")


def build(name: str) -> object:
    seeded = {"grad_vac", "pcgrad", "rlw"}
    return make_harmonizer(name, seed=0) if name in seeded else make_harmonizer(name)


def stress_stacks() -> list[tuple[str, torch.Tensor]]:
    stacks = [
        (f"spread64-{count}", spread_stack(count, count, 12, (-16.0, 16.0)))
        for count in (2, 3, 5, 8)
    ]
    stacks += [
        (f"spread32-{count}", spread_stack(count, count, 12, (-30.0, 30.0)).float())
        for count in (3, 5)
    ]
    stacks += [
        (f"{kind}-{count}", near_singular_stack(kind, count, count))
        for kind in NEAR_SINGULAR_KINDS
        for count in (2, 5, 16)
    ]
    return stacks


@pytest.mark.parametrize("name", OTHER_METHODS)
def test_other_methods_never_drop_or_fail_on_stress_stacks(name: str) -> None:
    for label, jacobian in stress_stacks():
        result = build(name)(jacobian)
        assert result.dropped == (), label
        assert torch.isfinite(result.weights).all(), label
        assert torch.isfinite(result.direction).all(), label


CAGRAD_STACKS = ("spread-4", "spread-8", "spread-16", *NEAR_SINGULAR_KINDS)


def cagrad_stack(family: str, seed: int, count: int) -> torch.Tensor:
    """float64 norms over 1e-e..1e+e ("spread-e") or a near-singular stack, D = 6..12."""
    dim = 6 + (3 * seed + count) % 7
    if family.startswith("spread"):
        exponent = float(family.split("-")[1])
        return spread_stack(seed, count, dim, (-exponent, exponent))
    return near_singular_stack(family, seed, count, dim)


@pytest.mark.parametrize("family", CAGRAD_STACKS)
@pytest.mark.parametrize("count", [2, 3, 5, 8])
def test_cagrad_matches_its_dual_at_wide_spread(family: str, count: int) -> None:
    for seed in range(2):
        jacobian = cagrad_stack(family, seed, count)
        result = make_harmonizer("cagrad")(jacobian)
        reference = cagrad_reference(jacobian.numpy())
        scale = float(jacobian.norm(dim=1).max())
        assert np.linalg.norm(result.direction.numpy() - reference) <= 1e-6 * scale
        assert result.fallback is None and result.dropped == ()
        # Relative certificate: g_k.d >= mu - residual (|mu| + ||g_k|| (||g0|| + s)); on 1e-7
        # near-singular stacks float64 resolves the small components to ~eps / 1e-7.
        assert result.kkt_residual < (1e-12 if family.startswith("spread") else 1e-7)
        if family.startswith("spread"):  # the Gram alone resolves these: weights suffice
            weights = make_harmonizer("cagrad")(gram=jacobian @ jacobian.T).weights
            assert np.linalg.norm((weights @ jacobian).numpy() - reference) <= 1e-6 * scale


@pytest.mark.parametrize("count", [2, 3, 5])
def test_imtlg_equal_projections_at_wide_spread(count: int) -> None:
    """IMTL-G's defining property: d has the same projection on every unit gradient."""
    for seed in range(3):
        jacobian = spread_stack(seed, count, 12, (-16.0, 16.0))
        direction = make_harmonizer("imtl_g")(jacobian).direction.numpy()
        projections = unit_rows(jacobian.numpy()) @ direction
        assert np.ptp(projections) <= 1e-9 * float(np.abs(projections).max())


@pytest.mark.parametrize("count", [2, 3, 5])
def test_nashmtl_bargaining_equation_at_wide_spread(count: int) -> None:
    """Nash-MTL (unclipped): alpha_k (g_k . d) = 1 for every objective."""
    for seed in range(3):
        jacobian = spread_stack(seed, count, 12, (-6.0, 6.0))
        result = make_harmonizer("nash_mtl", max_norm=0.0)(jacobian)
        if result.fallback is not None:
            continue
        products = (jacobian @ result.direction) * result.weights
        assert np.allclose(products.numpy(), 1.0, rtol=0, atol=1e-9), products
        assert math.isfinite(float(result.direction.norm()))


def pcgrad_reference(jacobian: np.ndarray, seed: int) -> np.ndarray:
    """PCGrad (Yu et al. 2020, Algorithm 1) on the vectors themselves, visiting the others
    in the order a generator seeded like ``PCGrad(seed=...)`` draws."""
    generator = torch.Generator().manual_seed(seed)
    projected = []
    for task in range(len(jacobian)):
        vector = jacobian[task].copy()
        for other in torch.randperm(len(jacobian), generator=generator).tolist():
            dot = float(vector @ jacobian[other])
            if other != task and dot < 0:
                vector -= dot / float(jacobian[other] @ jacobian[other]) * jacobian[other]
        projected.append(vector)
    return np.sum(projected, axis=0)


@pytest.mark.parametrize("count", [2, 3, 5, 8])
def test_pcgrad_matches_its_definition_on_stress_stacks(count: int) -> None:
    for seed in range(3):
        for jacobian in (
            spread_stack(seed, count, 12, (-16.0, 16.0)),
            near_singular_stack("opposed_pair", seed, count),
            near_singular_stack("near_duplicates", seed, count),
        ):
            ours = make_harmonizer("pcgrad", seed=seed)(jacobian).direction.numpy()
            reference = pcgrad_reference(jacobian.numpy(), seed)
            scale = float(jacobian.norm(dim=1).max())
            assert np.linalg.norm(ours - reference) <= 1e-9 * scale
