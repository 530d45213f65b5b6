"""CAGrad, NashMTL, UPGrad, DualProj, IMTL-G, Aligned-MTL, GradVac and the dual-cone QP.

Each method gets a published value or a defining property, a cross-check against the
TorchJD aggregator of the same name where the definitions agree, and bad-input tests.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import mogradient
import mogradient.harmonizers
from mogradient import (
    IMTLG,
    AlignedMTL,
    CAGrad,
    DualProj,
    GradVac,
    NashMTL,
    PCGrad,
    UPGrad,
    make_harmonizer,
)
from mogradient._qp_cone import cone_kkt_residual, solve_cone_qp

aggregation = pytest.importorskip("torchjd.aggregation")
dual_cone = pytest.importorskip("torchjd._linalg")

NEW_METHODS = ("cagrad", "nashmtl", "upgrad", "dualproj", "imtlg", "alignedmtl", "gradvac")
TORCHJD_EXAMPLE = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]], dtype=torch.float64)
# TorchJD's projector without its trace normalization and 1e-4 ridge: the exact QP.
EXACT_PROJECTOR = dual_cone.QuadprogProjector(norm_eps=0.0, reg_eps=0.0)

finite_floats = st.floats(-10, 10, allow_nan=False, allow_infinity=False, width=64)


@st.composite
def jacobians(draw: st.DrawFn, max_objectives: int = 5) -> torch.Tensor:
    count = draw(st.integers(2, max_objectives))
    dim = draw(st.integers(1, 7))
    values = draw(arrays(np.float64, (count, dim), elements=finite_floats))
    jacobian = torch.from_numpy(values)
    # Keep every row usable: dropping is the base class's job and tested there.
    return jacobian[jacobian.norm(dim=1) > 1e-3]


def random_jacobian(seed: int, count: int, dim: int, spread: float = 0.0) -> torch.Tensor:
    """Gaussian rows with norms spread over 10^(+-spread)."""
    generator = torch.Generator().manual_seed(seed)
    jacobian = torch.randn(count, dim, generator=generator, dtype=torch.float64)
    scales = 10 ** (spread * (2 * torch.rand(count, 1, generator=generator) - 1))
    return jacobian * scales.to(torch.float64)


def well_conditioned(jacobian: torch.Tensor) -> bool:
    """Full row rank with a moderate condition number: weights are then unique and stable."""
    singular = torch.linalg.svdvals(jacobian / jacobian.norm(dim=1, keepdim=True))
    return len(jacobian) <= jacobian.shape[1] and bool(singular.min() > 1e-3 * singular.max())


def build(name: str, **options: object) -> mogradient.Harmonizer:
    if name == "gradvac":
        options.setdefault("seed", 0)
    return make_harmonizer(name, **options)


# --- registry ------------------------------------------------------------------------


@pytest.mark.parametrize("name", NEW_METHODS)
def test_registered_and_usable_with_defaults(name: str) -> None:
    harmonizer = make_harmonizer(name)
    cls = type(harmonizer)
    assert mogradient.harmonizers.HARMONIZERS[name] is cls
    assert cls.__name__ in mogradient.__all__ and cls.__name__ in mogradient.harmonizers.__all__
    assert cls.__doc__ and "20" in cls.__doc__.splitlines()[0]  # cites author and year
    result = harmonizer(TORCHJD_EXAMPLE)
    assert result.weights.shape == (2,) and torch.isfinite(result.weights).all()
    torch.testing.assert_close(result.direction, result.weights @ TORCHJD_EXAMPLE)
    gram_only = make_harmonizer(name, **({"seed": 0} if name == "gradvac" else {}))
    again = make_harmonizer(name, **({"seed": 0} if name == "gradvac" else {}))
    torch.testing.assert_close(
        gram_only(gram=TORCHJD_EXAMPLE @ TORCHJD_EXAMPLE.T).weights, again(TORCHJD_EXAMPLE).weights
    )


@pytest.mark.parametrize("name", NEW_METHODS)
def test_dropped_objective_gets_zero_weight(name: str) -> None:
    jacobian = random_jacobian(3, 4, 6)
    jacobian[2] = 0.0
    result = build(name)(jacobian)
    assert result.dropped == (2,) and result.weights[2] == 0
    reference = build(name)(jacobian[[0, 1, 3]])
    torch.testing.assert_close(result.weights[[0, 1, 3]], reference.weights)


@pytest.mark.parametrize("name", NEW_METHODS)
@pytest.mark.parametrize("scale", [1e-10, 1e10])
def test_weights_are_scale_invariant(name: str, scale: float) -> None:
    jacobian = random_jacobian(5, 4, 7, spread=1.0)
    options = {"max_norm": 0.0} if name == "nashmtl" else {}
    base = build(name, **options)(jacobian).weights
    scaled = build(name, **options)(jacobian * scale).weights
    # Nash-MTL's alpha scales as 1/scale (G alpha = 1/alpha); the others are invariant.
    factor = scale if name == "nashmtl" else 1.0
    torch.testing.assert_close(scaled * factor, base, rtol=1e-9, atol=0)


# --- published values ----------------------------------------------------------------


def test_upgrad_reproduces_torchjd_regression_value() -> None:
    # TorchJD's documented output; its default projector solves on G/tr(G) + 1e-4 I.
    result = UPGrad(reg_eps=1e-4)(TORCHJD_EXAMPLE)
    expected = torch.tensor([0.2929, 1.9004, 1.9004], dtype=torch.float64)
    torch.testing.assert_close(result.direction, expected, atol=5e-5, rtol=0)
    torch.testing.assert_close(
        result.direction, aggregation.UPGrad()(TORCHJD_EXAMPLE), atol=1e-9, rtol=0
    )


def test_exact_upgrad_on_torchjd_example_matches_closed_form() -> None:
    # G = [[18, -22], [-22, 38]]. Projecting g1/2: v = (1/2, 22/76) (G v = (50/19, 0) >= 0);
    # projecting g2/2: v = (22/36, 1/2). Their sum is (10/9, 15/19).
    result = UPGrad()(TORCHJD_EXAMPLE)
    weights = torch.tensor([10 / 9, 15 / 19], dtype=torch.float64)
    torch.testing.assert_close(result.weights, weights, atol=1e-14, rtol=0)
    torch.testing.assert_close(result.direction, weights @ TORCHJD_EXAMPLE, atol=1e-13, rtol=0)
    assert result.direction[0] == pytest.approx(0.2924, abs=1e-4)
    assert result.kkt_residual < 1e-14


def test_dualproj_on_torchjd_example_matches_closed_form() -> None:
    # v >= (1/2, 1/2): the optimum keeps v2 = 1/2 and moves v1 to 22/36 so that g1 . d = 0.
    result = DualProj()(TORCHJD_EXAMPLE)
    torch.testing.assert_close(
        result.weights, torch.tensor([11 / 18, 0.5], dtype=torch.float64), atol=1e-14, rtol=0
    )
    assert abs(float(TORCHJD_EXAMPLE[0] @ result.direction)) < 1e-13


# --- cross-checks against TorchJD ----------------------------------------------------


CROSS_CHECK_SHAPES = [(2, 3, 0), (3, 5, 1), (4, 4, 0), (5, 9, 2), (6, 10, 1)]


@pytest.mark.parametrize(("count", "dim", "spread"), CROSS_CHECK_SHAPES)
def test_exact_methods_match_torchjd(count: int, dim: int, spread: float) -> None:
    jacobian = random_jacobian(count * 100 + dim, count, dim, spread)
    pairs = [
        (UPGrad(), aggregation.UPGrad(projector=EXACT_PROJECTOR)),
        (DualProj(), aggregation.DualProj(projector=EXACT_PROJECTOR)),
        (UPGrad(reg_eps=1e-4), aggregation.UPGrad()),
        (DualProj(reg_eps=1e-4), aggregation.DualProj()),
        (IMTLG(), aggregation.IMTLG()),
        (AlignedMTL(), aggregation.AlignedMTL()),
        (AlignedMTL(scale_mode="median"), aggregation.AlignedMTL(scale_mode="median")),
        (AlignedMTL(scale_mode="rmse"), aggregation.AlignedMTL(scale_mode="rmse")),
    ]
    preferences = torch.linspace(0.5, 2.0, count, dtype=torch.float64)
    pairs += [
        (UPGrad(pref_vector=preferences), aggregation.UPGrad(preferences, EXACT_PROJECTOR)),
        (DualProj(pref_vector=preferences), aggregation.DualProj(preferences, EXACT_PROJECTOR)),
        (AlignedMTL(pref_vector=preferences), aggregation.AlignedMTL(preferences)),
    ]
    scale = float(jacobian.norm(dim=1).max())
    for ours, theirs in pairs:
        torch.testing.assert_close(
            ours(jacobian).direction, theirs(jacobian), atol=1e-9 * scale, rtol=1e-9
        )


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


def test_gradvac_matches_torchjd_over_several_steps() -> None:
    # Same update and the same per-task shuffle: torch.randperm(K - 1) per task, so a
    # generator seeded like TorchJD's global RNG visits the pairs in the same order.
    # eps=0 on both sides because ours is relative to the largest norm, TorchJD's absolute.
    ours = GradVac(beta=0.3, eps=0.0, seed=11)
    torch.manual_seed(11)
    theirs = aggregation.GradVac(beta=0.3, eps=0.0)
    for step in range(6):
        jacobian = random_jacobian(step, 4, 6, spread=0.5)
        expected = theirs(jacobian)
        torch.testing.assert_close(ours(jacobian).direction, expected, atol=1e-12, rtol=1e-12)


# --- properties ----------------------------------------------------------------------


# Found by Hypothesis on an AMD EPYC: a near-opposed pair plus a third gradient, where
# every v >= lower is ~1e6 and the old normal-equations solver stopped infeasible.
AMD_COUNTEREXAMPLE = torch.tensor(
    [[-1.0, -5.9605e-08], [0.5, -5.9605e-08], [-5.9605e-08, 1.0]], dtype=torch.float64
)


# Found by `make fuzz`: an opposed pair with 1e-6 noise; weights ~1e5 cancel.
OPPOSED_PAIR = torch.tensor(
    [[-1.0, 1.0462e-06, 1.0462e-06], [1.0462e-06, -1.0, 1.0462e-06], [1.0, 1.0462e-06, 1.0462e-06]],
    dtype=torch.float64,
)


# Found by `make fuzz`: a pair conflicting by cos -5.7e-9, whose projection shortens the
# residual by less than round-off (the solver used to take that for no progress).
BARELY_CONFLICTING = torch.tensor(
    [
        [4.94094317784735359567e00, 0.0, -5.96046447753906250000e-08],
        [0.0, 7.01525729847189083443e00, 3.79847227209037896500e00],
    ],
    dtype=torch.float64,
)


# Found by `make fuzz`: g and -g + 1e-10 e_2: the dual cone is a plane, which needs both
# constraints active although they are 1e-10 from parallel.
OPPOSED_AT_1E_10 = torch.tensor(
    [[-1.0, 1e-10, 0.0, 0.0], [0.0, -1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]], dtype=torch.float64
)


@given(jacobians(), st.sampled_from(["upgrad", "dualproj"]))
@example(OPPOSED_AT_1E_10, "upgrad")
@example(BARELY_CONFLICTING, "upgrad")
@example(AMD_COUNTEREXAMPLE, "upgrad")
@example(AMD_COUNTEREXAMPLE, "dualproj")
@example(OPPOSED_PAIR, "upgrad")
@example(OPPOSED_PAIR, "dualproj")
def test_upgrad_and_dualproj_never_conflict(jacobian: torch.Tensor, name: str) -> None:
    if len(jacobian) < 2:
        return
    result = build(name)(jacobian)
    scale = float(jacobian.norm(dim=1).max()) ** 2
    assert (jacobian @ result.direction).min() >= -1e-12 * scale
    assert result.kkt_residual < 1e-9
    if well_conditioned(jacobian):
        # Unique weights, so they are the textbook v >= lower. Near-dependent stacks
        # may get min-norm weights of either sign instead (same direction, no cancellation).
        assert (result.weights >= 0).all()


@given(
    jacobians(),
    st.sampled_from(["upgrad", "dualproj", "cagrad", "nashmtl", "imtlg", "alignedmtl"]),
    st.randoms(use_true_random=False),
)
def test_permuting_objectives_permutes_weights(jacobian: torch.Tensor, name: str, random) -> None:
    # GradVac is left out: its random visiting order makes it order-dependent by design.
    if len(jacobian) < 2:
        return
    order = list(range(len(jacobian)))
    random.shuffle(order)
    base, permuted = build(name)(jacobian), build(name)(jacobian[order])
    scale = float(jacobian.norm(dim=1).max())
    weight_scale = float(base.weights.abs().max()) + 1e-300
    if name in ("nashmtl", "imtlg", "alignedmtl") and not well_conditioned(jacobian):
        return  # ill-posed there (no Nash solution / pinv / eigen-threshold ties)
    torch.testing.assert_close(
        permuted.direction, base.direction, atol=1e-7 * max(scale, 1e-300), rtol=1e-7
    )
    if well_conditioned(jacobian):
        torch.testing.assert_close(
            permuted.weights, base.weights[order], atol=1e-7 * weight_scale, rtol=1e-7
        )


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


@pytest.mark.parametrize("seed", range(4))
def test_imtlg_gives_equal_projections(seed: int) -> None:
    jacobian = random_jacobian(seed, 2 + seed, 8, spread=2.0)
    result = IMTLG()(jacobian)
    units = jacobian / jacobian.norm(dim=1, keepdim=True)
    projections = units @ result.direction
    torch.testing.assert_close(
        projections, projections.mean().expand_as(projections), atol=1e-10, rtol=1e-10
    )
    assert result.weights.sum() == pytest.approx(1.0, abs=1e-12)
    assert projections.min() > 0 and result.kkt_residual < 1e-10


def test_imtlg_negative_sum_keeps_projections_positive() -> None:
    # Here sum(pinv(G) norms) < 0: TorchJD's (and the paper's) sum-to-one normalization
    # returns d with d . u_k < 0 for every k; we divide by |sum| instead.
    jacobian = torch.tensor(
        [[-0.8, 0.0, -0.7], [0.5, -1.3, 0.2], [0.0, -0.1, 0.0]], dtype=torch.float64
    )
    result = IMTLG()(jacobian)
    assert result.fallback == "negative_sum"
    torch.testing.assert_close(result.direction, -aggregation.IMTLG()(jacobian))
    units = jacobian / jacobian.norm(dim=1, keepdim=True)
    assert (units @ result.direction).min() > 0


def test_imtlg_cancelling_gradients_give_zero() -> None:
    angles = torch.tensor([0.0, 2 * math.pi / 3, 4 * math.pi / 3], dtype=torch.float64)
    jacobian = torch.stack([angles.cos(), angles.sin()], dim=1)
    result = IMTLG()(jacobian)
    assert result.fallback == "degenerate" and (result.weights == 0).all()


@pytest.mark.parametrize("seed", range(3))
def test_alignedmtl_aligned_gradients_are_orthogonal_with_equal_norms(seed: int) -> None:
    count = 3 + seed
    jacobian = random_jacobian(seed, count, 10, spread=1.5)
    # With a one-hot preference the weights are the balance matrix's column: stack them.
    balance = torch.stack(
        [AlignedMTL(pref_vector=torch.eye(count)[k])(jacobian).weights for k in range(count)],
        dim=1,
    )
    aligned = balance.T @ jacobian  # rows: aligned gradients
    smallest = torch.linalg.eigvalsh(jacobian @ jacobian.T).min()
    torch.testing.assert_close(
        aligned @ aligned.T,
        smallest * torch.eye(count, dtype=torch.float64),
        atol=1e-9 * float(smallest),
        rtol=0,
    )


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


def test_gradvac_first_step_is_pcgrad_for_two_objectives() -> None:
    # Targets start at 0, and the correction towards 0 is PCGrad's projection.
    jacobian = torch.tensor([[1.0, 0.0], [-1.0, 1.0]], dtype=torch.float64)
    gradvac = GradVac(beta=0.25, seed=0)
    torch.testing.assert_close(gradvac(jacobian).weights, PCGrad(seed=0)(jacobian).weights)
    cosine = -1 / math.sqrt(2)
    assert gradvac.targets == pytest.approx({(0, 1): 0.25 * cosine, (1, 0): 0.25 * cosine})


def test_gradvac_state_is_keyed_by_original_indices() -> None:
    gradvac = GradVac(seed=0)
    jacobian = random_jacobian(2, 3, 5)
    gradvac(jacobian)
    before = gradvac.targets
    assert set(before) == {(i, j) for i in range(3) for j in range(3) if i != j}
    jacobian[1] = 0.0  # objective 1 is dropped for this step
    gradvac(jacobian)
    after = gradvac.targets
    for key in [(0, 1), (1, 0), (1, 2), (2, 1)]:
        assert after[key] == before[key]
    assert after[(0, 2)] != before[(0, 2)] and after[(2, 0)] != before[(2, 0)]
    gradvac.reset()
    assert gradvac.targets == {}


def test_gradvac_reaches_its_targets() -> None:
    # With a positive target every corrected gradient's cosine to the others is lifted to it.
    gradvac = GradVac(beta=1.0, eps=0.0, seed=0)
    gradvac._targets.update({(0, 1): 0.5, (1, 0): 0.5})
    jacobian = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    weights = gradvac(jacobian).weights
    # g0' = g0 + a g1 with cos(g0', g1) = 0.5: a * 2 / sqrt(1 + 4 a^2) = 0.5.
    assert weights[1] == pytest.approx(1 + 1 / (2 * math.sqrt(3)), rel=1e-12)
    assert weights[0] == pytest.approx(1 + 2 / math.sqrt(3), rel=1e-12)


# --- the dual-cone QP ----------------------------------------------------------------


def external_backends() -> list[str]:
    backends = []
    try:
        import cvxpy  # noqa: F401

        backends.append("cvxpy")
    except ImportError:
        pass
    try:
        import qpsolvers

        backends += [
            f"qpsolvers:{name}"
            for name in ("quadprog", "clarabel")
            if name in qpsolvers.available_solvers
        ]
    except ImportError:
        pass
    return backends


@pytest.mark.parametrize("scale", [1e-10, 1e-5, 1.0, 1e5, 1e10])
@pytest.mark.parametrize("rank_deficient", [False, True])
def test_cone_qp_matches_external_solvers(scale: float, rank_deficient: bool) -> None:
    backends = external_backends()
    if not backends:
        pytest.skip("no external QP solver installed")
    rng = np.random.default_rng(int(math.log10(scale)) + 20 * rank_deficient + 40)
    for _ in range(6):
        count = int(rng.integers(3, 9))
        dim = int(rng.integers(1, count)) if rank_deficient else int(rng.integers(count, 12))
        jacobian = rng.standard_normal((count, dim)) * 10 ** rng.uniform(-1, 1, (count, 1))
        jacobian *= math.sqrt(scale)
        gram = jacobian @ jacobian.T
        lower = np.abs(rng.standard_normal(count)) * (rng.random(count) < 0.7)
        lower[rng.integers(count)] = 1.0
        ours = solve_cone_qp(gram, lower)
        reference = float(np.linalg.norm(jacobian.T @ lower))
        assert ours.kkt_residual < 1e-10
        assert (ours.weights >= lower).all()
        assert (gram @ ours.weights).min() >= -1e-10 * reference * np.sqrt(gram.diagonal().max())
        for backend in backends:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    theirs = solve_cone_qp(gram, lower, backend=backend)
                except Exception:  # an external solver failing is not our bug
                    continue
            # Objectives from J (not G) so round-off cannot make them negative. Ours is
            # never worse, and as d* = J^T v* is the projection of J^T lower onto a convex
            # set, ||d - d*||^2 <= ||d||^2 - ||d*||^2 for any feasible d: the directions
            # must agree up to what the external solver's objective gap allows.
            our_value = float(np.sum((jacobian.T @ ours.weights) ** 2)) / reference**2
            their_value = float(np.sum((jacobian.T @ theirs.weights) ** 2)) / reference**2
            assert our_value <= their_value + 1e-12, backend
            gap = np.linalg.norm(jacobian.T @ (ours.weights - theirs.weights)) / reference
            assert gap <= math.sqrt(max(their_value - our_value, 0.0)) + 1e-6, backend


def test_cone_qp_trivial_and_invalid_inputs() -> None:
    gram = np.array([[1.0, -1.0], [-1.0, 1.0]])
    zero = solve_cone_qp(gram, np.zeros(2))
    assert (zero.weights == 0).all() and zero.kkt_residual == 0
    cancelling = solve_cone_qp(gram, np.ones(2))  # J^T lower = 0: lower itself is optimal
    assert cancelling.objective == pytest.approx(0.0, abs=1e-15)
    assert cone_kkt_residual(gram, np.ones(2), cancelling.weights) == 0
    with pytest.raises(ValueError, match="square"):
        solve_cone_qp(np.ones((2, 3)), np.ones(2))
    with pytest.raises(ValueError, match="one entry per objective"):
        solve_cone_qp(np.eye(2), np.ones(3))
    with pytest.raises(ValueError, match="finite"):
        solve_cone_qp(np.array([[np.nan, 0.0], [0.0, 1.0]]), np.ones(2))
    with pytest.raises(ValueError, match="unknown QP backend"):
        solve_cone_qp(np.eye(2), np.ones(2), backend="nope")


# --- constructor validation ----------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("cagrad", {"c": -0.1}, "c must be"),
        ("cagrad", {"c": float("nan")}, "c must be"),
        ("nashmtl", {"max_norm": -1.0}, "max_norm"),
        ("nashmtl", {"max_iterations": 0}, "max_iterations"),
        ("upgrad", {"pref_vector": [1.0, -1.0]}, "pref_vector"),
        ("upgrad", {"pref_vector": [[1.0, 1.0]]}, "pref_vector"),
        ("upgrad", {"reg_eps": -1e-4}, "reg_eps"),
        ("dualproj", {"pref_vector": [0.0, 0.0]}, "pref_vector"),
        ("alignedmtl", {"scale_mode": "max"}, "scale_mode"),
        ("gradvac", {"beta": 1.5}, "beta"),
        ("gradvac", {"eps": -1.0}, "eps"),
    ],
)
def test_invalid_options_are_rejected(name: str, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_harmonizer(name, **options)


def test_too_few_preferences_is_an_error() -> None:
    with pytest.raises(ValueError, match="one preference per objective"):
        UPGrad(pref_vector=[1.0, 1.0])(random_jacobian(0, 3, 4))
