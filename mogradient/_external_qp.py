"""Independent QP backends (cvxpy, qpsolvers) used to cross-check the exact built-in solvers.

Both problems in the package are min v^T G v with G PSD, over a simplex
{v >= 0, c . v = 1} (MGDA; c = 1 is the probability simplex) or over v >= lower
(UPGrad / DualProj). Tolerances are set as tight as each solver accepts, so that
disagreements point at a real difference.
"""

from __future__ import annotations

import numpy as np

from mogradient.errors import SolverError

TIGHT_QPSOLVERS_OPTIONS: dict[str, dict[str, float]] = {
    "clarabel": {"tol_gap_abs": 1e-12, "tol_gap_rel": 1e-12, "tol_feas": 1e-12},
    "daqp": {"primal_tol": 1e-14, "dual_tol": 1e-14},
    "osqp": {"eps_abs": 1e-12, "eps_rel": 1e-12, "max_iter": 200000, "polish": True},
    "proxqp": {"eps_abs": 1e-14, "eps_rel": 0.0},
}
# Strictly convex solvers (quadprog) need a positive-definite matrix; on a problem
# normalized to unit scale this ridge moves the optimum by O(1e-14).
_RIDGE = 1e-14


def solve_with_cvxpy(
    gram: np.ndarray, lower: np.ndarray | None = None, simplex: np.ndarray | None = None
) -> np.ndarray:
    """Minimize v^T G v over v >= lower, or (``lower=None``) over the simplex
    {v >= 0, simplex . v = 1} (default all ones), with Clarabel."""
    try:
        import cvxpy as cp
    except ImportError as error:
        raise ImportError("the 'cvxpy' backend needs: pip install 'mogradient[solvers]'") from error
    weights = cp.Variable(len(gram))
    if lower is None:
        constraints = [weights >= 0, _simplex_coefficients(simplex, len(gram)) @ weights == 1]
    else:
        constraints = [weights >= lower]
    problem = cp.Problem(cp.Minimize(cp.sum_squares(psd_factor(gram) @ weights)), constraints)
    problem.solve(solver=cp.CLARABEL, **TIGHT_QPSOLVERS_OPTIONS["clarabel"])
    if weights.value is None:
        raise SolverError(f"cvxpy could not solve the QP: status {problem.status}")
    return np.asarray(weights.value, dtype=np.float64)


def solve_with_qpsolvers(
    gram: np.ndarray,
    solver: str,
    lower: np.ndarray | None = None,
    simplex: np.ndarray | None = None,
) -> np.ndarray:
    """Minimize v^T G v over v >= lower, or (``lower=None``) over the simplex
    {v >= 0, simplex . v = 1} (default all ones), with a qpsolvers solver."""
    try:
        import qpsolvers
    except ImportError as error:
        raise ImportError(
            "the 'qpsolvers' backend needs: pip install 'mogradient[solvers]'"
        ) from error
    num = len(gram)
    coefficients = _simplex_coefficients(simplex, num) if lower is None else None
    solution = qpsolvers.solve_qp(
        P=2.0 * gram + _RIDGE * np.eye(num),
        q=np.zeros(num),
        A=None if coefficients is None else coefficients[None, :],
        b=None if coefficients is None else np.ones(1),
        lb=np.zeros(num) if coefficients is not None else lower,
        # v_k <= 1 / c_k follows from the others; bounded boxes help some solvers.
        ub=None if coefficients is None else 1.0 / coefficients,
        solver=solver,
        **TIGHT_QPSOLVERS_OPTIONS.get(solver, {}),
    )
    if solution is None:
        raise SolverError(f"qpsolvers solver {solver!r} found no solution of the QP")
    return np.asarray(solution, dtype=np.float64)


def _simplex_coefficients(simplex: np.ndarray | None, count: int) -> np.ndarray:
    """Positive coefficients c of the simplex's equality c . v = 1 (all ones by default)."""
    if simplex is None:
        return np.ones(count)
    return np.asarray(simplex, dtype=np.float64).reshape(count)


def psd_factor(gram: np.ndarray) -> np.ndarray:
    """A matrix F with F^T F = gram (gram PSD up to round-off)."""
    eigenvalues, eigenvectors = np.linalg.eigh(gram)
    return (eigenvectors * np.sqrt(np.clip(eigenvalues, 0.0, None))).T
