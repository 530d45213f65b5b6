"""The dual-cone methods (UPGrad, DualProj) and their cone QP, against TorchJD and external
solvers."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from mogradient._qp_cone import cone_kkt_residual, solve_cone_qp
from mogradient.harmonizers import IMTLG, AlignedMTL, DualProj, UPGrad

from .stacks import CROSS_CHECK_SHAPES, build, jacobians, random_jacobian, well_conditioned

aggregation = pytest.importorskip("torchjd.aggregation")


dual_cone = pytest.importorskip("torchjd._linalg")


# TorchJD's projector without its trace normalization and 1e-4 ridge: the exact QP.
EXACT_PROJECTOR = dual_cone.QuadprogProjector(norm_eps=0.0, reg_eps=0.0)


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


@given(jacobians(), st.sampled_from(["upgrad", "dual_proj"]))
@example(OPPOSED_AT_1E_10, "upgrad")
@example(BARELY_CONFLICTING, "upgrad")
@example(AMD_COUNTEREXAMPLE, "upgrad")
@example(AMD_COUNTEREXAMPLE, "dual_proj")
@example(OPPOSED_PAIR, "upgrad")
@example(OPPOSED_PAIR, "dual_proj")
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
