"""UPGrad's K dual-cone QPs solved together (mogradient._batched_cone): exact against an
independent solver, certified without the one-by-one solver where pivoting converges, the
one-by-one solver where it does not, and a warning when a solve is slow.

The reference is UPGrad's d-space definition, (1/K) sum_i of the projection of g_i onto
{d : J d >= 0}, solved on the stack itself by quadprog (Goldfarb-Idnani), with
cvxpy/Clarabel where quadprog refuses a degenerate constraint set. Speed is measured in
benchmarks/bench_upgrad_scaling.py, not here.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import mogradient._qp_cone as qp_cone
from mogradient.harmonizers import UPGrad
from mogradient.harmonizers import _upgrad as upgrad
from mogradient.qp import gram_matrix

cp = pytest.importorskip("cvxpy")
qpsolvers = pytest.importorskip("qpsolvers")

COUNTS = (2, 3, 5, 8, 16, 32, 64)
KINDS = ("well_conditioned", "ill_conditioned", "rank_deficient", "duplicates")
CLARABEL = {"tol_gap_abs": 1e-13, "tol_gap_rel": 1e-13, "tol_feas": 1e-13, "max_iter": 400}


def stack(kind: str, count: int, dtype: torch.dtype) -> torch.Tensor:
    """K x (K + 3) gradients: Gaussian; singular values 1..1e-4 (cosine eigenvalues down to
    ~1e-8); rank K / 2; or every third row a copy of the one before (duplicated samples)."""
    rng = np.random.default_rng(count)
    dim = count + 3
    rows = rng.standard_normal((count, dim))
    if kind == "ill_conditioned":
        left = np.linalg.qr(rng.standard_normal((count, count)))[0]
        right = np.linalg.qr(rng.standard_normal((dim, count)))[0]
        rows = left @ np.diag(np.logspace(0, -4, count)) @ right.T
    elif kind == "rank_deficient":
        rank = max(1, count // 2)
        rows = rng.standard_normal((count, rank)) @ rng.standard_normal((rank, dim))
    elif kind == "duplicates":
        rows[1::3] = rows[0::3][: len(rows[1::3])]
    return torch.from_numpy(rows).to(dtype)


def dual_cone_projection(rows: np.ndarray, point: np.ndarray) -> np.ndarray:
    """argmin ||d - point|| subject to rows @ d >= 0, solved in d-space."""
    size = float(np.linalg.norm(point))
    units = rows / np.linalg.norm(rows, axis=1, keepdims=True)
    solution = qpsolvers.solve_ls(
        np.eye(len(point)), point / size, G=-units, h=np.zeros(len(rows)), solver="quadprog"
    )
    if solution is None:
        direction = cp.Variable(len(point))
        problem = cp.Problem(
            cp.Minimize(cp.sum_squares(direction - point / size)), [units @ direction >= 0]
        )
        problem.solve(solver=cp.CLARABEL, **CLARABEL)
        solution = np.asarray(direction.value)
    return size * solution


def upgrad_reference(rows: np.ndarray) -> np.ndarray:
    return sum(dual_cone_projection(rows, row / len(rows)) for row in rows)


def tolerance(kind: str, count: int, dtype: torch.dtype) -> float:
    """Direction error allowed, relative to the largest gradient.

    A Gram in ``dtype`` carries ~eps of each product: well-conditioned problems keep that
    (64 K eps). Near-dependent gradients are resolved only to ~sqrt(eps) of their norms
    (||noise||^2 ~ eps), so there the bound is sqrt(eps).
    """
    eps = torch.finfo(dtype).eps
    if kind in ("well_conditioned", "duplicates"):
        return 64 * count * eps
    return eps**0.5


@pytest.mark.filterwarnings("ignore::mogradient.harmonizers.SlowSolveWarning")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("count", COUNTS)
def test_upgrad_matches_independent_solver(count: int, kind: str, dtype: torch.dtype) -> None:
    jacobian = stack(kind, count, dtype)
    rows = jacobian.double().numpy()
    reference = upgrad_reference(rows)
    scale = float(np.linalg.norm(rows, axis=1).max())
    allowed = tolerance(kind, count, dtype)
    from_gram = UPGrad()(gram=gram_matrix(jacobian))
    from_stack = UPGrad()(jacobian)
    for result in (from_gram, from_stack):
        direction = rows.T @ result.weights.numpy()
        assert np.linalg.norm(direction - reference) <= allowed * scale
        assert float((rows @ direction).min()) >= -allowed * scale**2
        assert result.kkt_residual < 1e-10


def count_one_by_one(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Calls of the one-by-one solver, counted from now on."""
    calls = [0]
    solve = qp_cone._solve_builtin

    def counted(*arguments: object) -> object:
        calls[0] += 1
        return solve(*arguments)

    monkeypatch.setattr(qp_cone, "_solve_builtin", counted)
    return calls


@pytest.mark.parametrize("kind", ["well_conditioned", "duplicates"])
def test_batched_solve_certifies_every_problem_where_pivoting_converges(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """K = 64 well-conditioned or duplicated gradients: no QP is left to the one-by-one
    solver, which is what makes large K affordable."""
    calls = count_one_by_one(monkeypatch)
    UPGrad()(gram=gram_matrix(stack(kind, 64, torch.float64)))
    assert calls[0] == 0


def test_uncertified_problems_are_solved_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank K / 2: pivoting cycles on most problems, which the one-by-one solver then
    solves; the result is still the exact one (checked against the reference above)."""
    calls = count_one_by_one(monkeypatch)
    jacobian = stack("rank_deficient", 32, torch.float64)
    result = UPGrad()(gram=gram_matrix(jacobian))
    assert calls[0] > 0
    rows = jacobian.numpy()
    direction = rows.T @ result.weights.numpy()
    scale = float(np.linalg.norm(rows, axis=1).max())
    allowed = tolerance("rank_deficient", 32, torch.float64)
    assert np.linalg.norm(direction - upgrad_reference(rows)) <= allowed * scale


def test_slow_solve_warns_once_per_instance(monkeypatch: pytest.MonkeyPatch) -> None:
    gram = gram_matrix(stack("well_conditioned", 6, torch.float64))
    with warnings.catch_warnings():
        warnings.simplefilter("error", upgrad.SlowSolveWarning)
        UPGrad()(gram=gram)  # fast: no warning
    monkeypatch.setattr(upgrad, "SLOW_SOLVE_SECONDS", -1.0)
    method = UPGrad()
    with pytest.warns(upgrad.SlowSolveWarning, match=r"K = 6 .*MGDA") as caught:
        method(gram=gram)
        method(gram=gram)
    assert len(caught) == 1
    assert "s to project" in str(caught[0].message)
    with pytest.warns(upgrad.SlowSolveWarning):
        UPGrad()(gram=gram)
