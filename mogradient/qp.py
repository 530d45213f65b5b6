"""Exact min-norm point of a convex hull: min_a a^T G a over the probability simplex.

This is the QP inside MGDA. K is small (2..16), so we solve it exactly in float64:
a closed form for K=2 and Wolfe's min-norm-point active-set method for larger K,
then report the KKT residual. External backends (``cvxpy``, ``qpsolvers:<name>``)
exist to cross-check the built-in solver.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mogradient.errors import SolverError
from mogradient.external_qp import solve_with_cvxpy, solve_with_qpsolvers

_MAX_ITERATIONS = 1000


@dataclass(frozen=True)
class SimplexQPSolution:
    """Optimal simplex weights with the optimum and a certificate of optimality."""

    weights: np.ndarray
    objective: float
    kkt_residual: float
    backend: str


def solve_simplex_qp(gram: np.ndarray, backend: str = "builtin") -> SimplexQPSolution:
    """Minimize ``a @ gram @ a`` subject to ``a >= 0, sum(a) = 1``.

    ``backend`` is ``"builtin"`` (exact, default), ``"cvxpy"`` or ``"qpsolvers:<solver>"``
    (e.g. ``"qpsolvers:quadprog"``). The gram is rescaled by its largest diagonal entry
    before solving, so results do not depend on the gradients' overall scale.
    """
    gram = _validated_gram(gram)
    scale = float(np.max(np.diag(gram)))
    if scale <= 0.0:
        weights = np.full(len(gram), 1.0 / len(gram))
        return SimplexQPSolution(weights, 0.0, 0.0, backend)
    normalized = gram / scale
    if backend == "builtin":
        weights = _solve_builtin(normalized)
    elif backend == "cvxpy":
        weights = solve_with_cvxpy(normalized)
    elif backend.startswith("qpsolvers:"):
        weights = solve_with_qpsolvers(normalized, backend.split(":", 1)[1])
    else:
        raise ValueError(
            f"unknown QP backend {backend!r}; use 'builtin', 'cvxpy' or 'qpsolvers:<solver>'"
        )
    weights = _project_to_simplex(weights)
    return SimplexQPSolution(
        weights=weights,
        objective=float(weights @ gram @ weights),
        kkt_residual=simplex_kkt_residual(normalized, weights),
        backend=backend,
    )


def simplex_kkt_residual(gram: np.ndarray, weights: np.ndarray) -> float:
    """Largest violation of the simplex QP's KKT conditions, in units of ``max(diag(gram))``.

    At the optimum every coordinate's partial derivative ``(G a)_k`` is at least the optimal
    value ``a^T G a``, with equality on the support of ``a``.
    """
    scale = max(float(np.max(np.diag(gram))), np.finfo(float).tiny)
    gradient = gram @ weights
    value = float(weights @ gradient)
    descent = np.max(np.maximum(value - gradient, 0.0))
    support = weights > 0
    complementarity = np.max(np.abs(weights[support] * (gradient[support] - value)))
    feasibility = max(abs(float(weights.sum()) - 1.0), float(np.max(np.maximum(-weights, 0.0))))
    return float(max(descent, complementarity) / scale + feasibility)


def _validated_gram(gram: np.ndarray) -> np.ndarray:
    gram = np.asarray(gram, dtype=np.float64)
    if gram.ndim != 2 or gram.shape[0] != gram.shape[1] or gram.shape[0] == 0:
        raise ValueError(f"the Gram matrix must be square and non-empty, got shape {gram.shape}")
    if not np.all(np.isfinite(gram)):
        raise ValueError("the Gram matrix contains NaN or Inf; drop non-finite gradients first")
    return 0.5 * (gram + gram.T)


def _project_to_simplex(weights: np.ndarray) -> np.ndarray:
    """Remove solver round-off (tiny negatives, sum off by 1e-12) without moving the optimum."""
    weights = np.maximum(np.asarray(weights, dtype=np.float64).reshape(-1), 0.0)
    total = weights.sum()
    if not np.isfinite(total) or total <= 0:
        raise SolverError("QP backend returned no usable solution")
    return weights / total


def _solve_builtin(gram: np.ndarray) -> np.ndarray:
    if len(gram) == 1:
        return np.ones(1)
    if len(gram) == 2:
        return _solve_two(gram)
    return _solve_wolfe(gram)


def _solve_two(gram: np.ndarray) -> np.ndarray:
    """Closed form for two points: the foot of the origin's perpendicular, clipped."""
    curvature = gram[0, 0] + gram[1, 1] - 2.0 * gram[0, 1]
    if curvature <= 0.0:
        return np.array([0.5, 0.5])
    first = float(np.clip((gram[1, 1] - gram[0, 1]) / curvature, 0.0, 1.0))
    return np.array([first, 1.0 - first])


def _solve_wolfe(gram: np.ndarray, tolerance: float = 1e-13) -> np.ndarray:
    """Wolfe's (1976) min-norm-point algorithm, written on inner products only.

    Keeps a corral (affinely independent support). Major cycle: add the vertex most
    opposed to the current point; minor cycles: move to the affine minimizer of the
    corral, dropping vertices whose weights would turn negative.
    """
    num = len(gram)
    start = int(np.argmin(np.diag(gram)))
    support = [start]
    weights = np.zeros(num)
    weights[start] = 1.0
    for _ in range(_MAX_ITERATIONS):
        gradient = gram @ weights
        value = float(weights @ gradient)
        candidate = int(np.argmin(gradient))
        if candidate in support or value - gradient[candidate] <= tolerance * max(1.0, value):
            break
        support.append(candidate)
        while True:
            affine = _affine_minimizer(gram, support)
            if affine is None:
                support.remove(candidate)
                return _polish(gram, weights)
            if np.all(affine > tolerance):
                weights[:] = 0.0
                weights[support] = affine
                break
            current = weights[support]
            decreasing = affine < current
            ratios = np.where(decreasing, current / np.maximum(current - affine, 1e-300), np.inf)
            ratios[affine > tolerance] = np.inf
            step = float(np.clip(np.min(ratios), 0.0, 1.0))
            new = current + step * (affine - current)
            keep = new > tolerance
            if not np.any(keep):
                keep[int(np.argmax(new))] = True
            weights[:] = 0.0
            support = [index for index, kept in zip(support, keep, strict=True) if kept]
            weights[support] = new[keep] / new[keep].sum()
    return _polish(gram, weights)


def _affine_minimizer(gram: np.ndarray, support: list[int]) -> np.ndarray | None:
    """Weights (summing to one) of the min-norm point of the support's affine hull."""
    size = len(support)
    system = np.zeros((size + 1, size + 1))
    system[:size, :size] = gram[np.ix_(support, support)]
    system[:size, size] = 1.0
    system[size, :size] = 1.0
    rhs = np.zeros(size + 1)
    rhs[size] = 1.0
    if np.linalg.cond(system) > 1e14:
        return None
    return np.linalg.solve(system, rhs)[:size]


def _polish(gram: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Re-solve the KKT system on the final support to remove accumulated round-off."""
    support = [int(index) for index in np.flatnonzero(weights > 0)]
    affine = _affine_minimizer(gram, support)
    if affine is None or np.any(affine < 0):
        return weights
    polished = np.zeros_like(weights)
    polished[support] = affine
    if polished @ gram @ polished <= weights @ gram @ weights:
        return polished
    return weights
