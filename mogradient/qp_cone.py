"""Exact dual-cone projection QP: min_v v^T G v subject to v >= lower (G PSD, maybe singular).

This is the QP inside UPGrad and DualProj. With G = J J^T, its solution v gives the
projection of J^T lower onto the dual cone {d : J d >= 0} as d = J^T v (Quinton & Rey
2024, Prop. 1). Substituting v = lower + x turns it into a non-negative least-squares
problem min ||J^T x + J^T lower||^2, x >= 0, which Lawson & Hanson's active-set method
solves exactly in finitely many steps using only the Gram matrix. K is small (2..64),
so we solve in float64 and report a KKT residual. ``cvxpy`` and ``qpsolvers:<name>``
backends exist to cross-check the built-in solver.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mogradient.external_qp import solve_with_cvxpy, solve_with_qpsolvers

_TOLERANCE = 1e-13


@dataclass(frozen=True)
class ConeQPSolution:
    """Optimal weights ``v`` with the optimum ``v^T G v`` and a certificate of optimality."""

    weights: np.ndarray
    objective: float
    kkt_residual: float
    backend: str


def solve_cone_qp(gram: np.ndarray, lower: np.ndarray, backend: str = "builtin") -> ConeQPSolution:
    """Minimize ``v @ gram @ v`` subject to ``v >= lower``.

    ``backend`` is ``"builtin"`` (exact active set, default), ``"cvxpy"`` or
    ``"qpsolvers:<solver>"``. The built-in solver works on the cosine matrix
    C = D^-1 G D^-1 (D = diag(||g_k||)) with y = D v >= D lower, an equivalent problem
    that stays well-conditioned when the gradients' norms differ by many orders of
    magnitude; the external backends get G / max(diag G) and lower / max|lower|. Results
    do not depend on overall scales. When ``gram`` is singular ``v`` need not be unique,
    but ``J^T v`` (the projection) is. Objectives with a zero row keep ``v_k = lower_k``.
    """
    gram, lower = _validated(gram, lower)
    gram_scale = float(np.max(np.diag(gram)))
    lower_scale = float(np.max(np.abs(lower)))
    if gram_scale <= 0.0 or lower_scale == 0.0:
        # Every feasible v (in particular v = lower) is optimal, or v = lower = 0.
        return ConeQPSolution(lower.copy(), float(lower @ gram @ lower), 0.0, backend)
    normalized_gram = gram / gram_scale
    normalized_lower = lower / lower_scale
    if backend == "builtin":
        weights = _solve_builtin(normalized_gram, normalized_lower)
    elif backend == "cvxpy":
        weights = solve_with_cvxpy(normalized_gram, normalized_lower)
    elif backend.startswith("qpsolvers:"):
        solver = backend.split(":", 1)[1]
        weights = solve_with_qpsolvers(normalized_gram, solver, normalized_lower)
    else:
        raise ValueError(
            f"unknown QP backend {backend!r}; use 'builtin', 'cvxpy' or 'qpsolvers:<solver>'"
        )
    # Solver round-off may leave v a hair below the bound; clipping only moves it inward.
    weights = np.maximum(weights, normalized_lower)
    residual = cone_kkt_residual(normalized_gram, normalized_lower, weights)
    weights = np.maximum(weights * lower_scale, lower)
    return ConeQPSolution(
        weights=weights,
        objective=float(weights @ gram @ weights),
        kkt_residual=residual,
        backend=backend,
    )


def cone_kkt_residual(gram: np.ndarray, lower: np.ndarray, weights: np.ndarray) -> float:
    """Largest relative violation of the KKT conditions of ``min v^T G v, v >= lower``.

    At the optimum ``G v >= 0`` (the projection d = J^T v conflicts with no gradient),
    ``v >= lower`` and ``(v - lower)_k (G v)_k = 0``. With P = ||J^T lower|| (an upper
    bound on ||d||), we report the largest of: max_k -g_k.d / (||g_k|| P) (a cosine),
    max_k (lower - v)_k / max|lower|, and max_k |(v - lower)_k (G v)_k| / P^2.
    """
    gram = np.asarray(gram, dtype=np.float64)
    lower = np.asarray(lower, dtype=np.float64)
    weights = np.asarray(weights, dtype=np.float64)
    tiny = np.finfo(float).tiny
    lower_scale = max(float(np.max(np.abs(lower))), tiny)
    primal = max(0.0, float(np.max(lower - weights))) / lower_scale
    projection_norm = np.sqrt(max(float(lower @ gram @ lower), 0.0))
    if projection_norm == 0.0:
        # J^T lower = 0: v = lower is optimal with objective 0; only primal feasibility counts.
        return primal
    norms = np.sqrt(np.clip(np.diag(gram), 0.0, None))
    products = gram @ weights
    cosines = np.where(norms > 0, -products / np.maximum(norms, tiny), 0.0) / projection_norm
    dual = max(0.0, float(np.max(cosines)))
    complementarity = float(np.max(np.abs((weights - lower) * products))) / projection_norm**2
    return max(dual, primal, complementarity)


def _solve_builtin(gram: np.ndarray, lower: np.ndarray) -> np.ndarray:
    """Jacobi-scale to unit diagonal, solve exactly, scale back."""
    norms = np.sqrt(np.clip(np.diag(gram), 0.0, None))
    rows = norms > 0
    weights = lower.copy()
    if not np.any(rows):
        return weights
    cosines = gram[np.ix_(rows, rows)] / np.outer(norms[rows], norms[rows])
    scaled_lower = lower[rows] * norms[rows]
    bound = float(np.max(np.abs(scaled_lower)))
    if bound == 0.0:
        return weights
    solution = _lawson_hanson(cosines, scaled_lower / bound) * bound
    weights[rows] = solution / norms[rows]
    return weights


def _validated(gram: np.ndarray, lower: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    gram = np.asarray(gram, dtype=np.float64)
    lower = np.asarray(lower, dtype=np.float64).reshape(-1)
    if gram.ndim != 2 or gram.shape[0] != gram.shape[1] or gram.shape[0] == 0:
        raise ValueError(f"the Gram matrix must be square and non-empty, got shape {gram.shape}")
    if lower.shape != (gram.shape[0],):
        raise ValueError(
            f"lower must have one entry per objective ({gram.shape[0]}), got shape {lower.shape}"
        )
    if not (np.all(np.isfinite(gram)) and np.all(np.isfinite(lower))):
        raise ValueError("the Gram matrix and lower bound must be finite")
    return 0.5 * (gram + gram.T), lower


def _lawson_hanson(gram: np.ndarray, lower: np.ndarray) -> np.ndarray:
    """Lawson & Hanson (1974) NNLS on the normal equations, for x = v - lower >= 0.

    Objective f(x) = (lower + x)^T G (lower + x). The passive set P holds the free
    coordinates; on P we solve G_PP x_P = -(G lower)_P exactly. In exact arithmetic the
    rows of J in P stay linearly independent (a row enters only if it has a positive
    component along the current residual), so G_PP is non-singular; a coordinate whose
    row is numerically dependent on P is excluded instead of entering. The method stops
    when no bound has a descending multiplier above round-off, or when round-off stops
    the objective from decreasing (the best point is kept).
    """
    num = len(gram)
    offset = gram @ lower
    base_tolerance = _TOLERANCE * np.sqrt(max(float(lower @ offset), 0.0))
    x = np.zeros(num)
    passive = np.zeros(num, dtype=bool)
    excluded = np.zeros(num, dtype=bool)
    best_value = float((lower + x) @ (offset + gram @ x))
    for _ in range(10 * num + 20):
        weights = lower + x
        descent = -(gram @ weights)
        # Round-off in (G v)_j is about eps * sum_k |G_jk v_k|; below that nothing is known.
        noise = base_tolerance + 64.0 * np.finfo(float).eps * (np.abs(gram) @ np.abs(weights))
        candidates = ~passive & ~excluded & (descent > noise)
        if not np.any(candidates):
            break
        entering = int(np.argmax(np.where(candidates, descent, -np.inf)))
        previous_x, previous_passive = x.copy(), passive.copy()
        passive[entering] = True
        for _ in range(10 * num + 20):
            solved = _solve_subproblem(gram, offset, passive)
            if solved is None:
                # The entering row is (numerically) a combination of the passive ones.
                passive[entering] = False
                excluded[entering] = True
                break
            trial = np.zeros(num)
            trial[passive] = solved
            if np.all(trial[passive] > 0.0):
                x = trial
                break
            blocking = passive & (trial <= 0.0)
            step = float(np.min(x[blocking] / (x[blocking] - trial[blocking])))
            x = x + step * (trial - x)
            passive &= x > _TOLERANCE * max(1.0, float(np.max(x)))
            passive[blocking & (step == 0.0)] = False
            x[~passive] = 0.0
            if not passive[entering]:
                excluded[entering] = True
                break
            if not np.any(passive):
                break
        value = float((lower + x) @ (offset + gram @ x))
        if value > best_value:
            # Round-off, not progress: keep the best point and stop.
            x, passive = previous_x, previous_passive
            break
        if value < best_value:
            excluded[:] = False
        best_value = value
    return lower + x


def _solve_subproblem(
    gram: np.ndarray, offset: np.ndarray, passive: np.ndarray
) -> np.ndarray | None:
    """Solve G_PP x_P = -(G lower)_P by Cholesky; None when G_PP is numerically singular."""
    block = gram[np.ix_(passive, passive)]
    rhs = -offset[passive]
    try:
        factor = np.linalg.cholesky(block)
    except np.linalg.LinAlgError:
        return None
    # A pivot below 1e-7 of the largest row norm means the rows are dependent to
    # within what a float64 Gram can resolve (its entries carry relative error ~1e-16).
    if np.min(np.diag(factor)) <= 1e-7 * np.sqrt(np.max(np.diag(block))):
        return None
    return np.linalg.solve(factor.T, np.linalg.solve(factor, rhs))
