"""Exact min-norm point of a convex hull: min_a a^T G a over the probability simplex.

This is the QP inside MGDA. K is small (2..16), so we solve it exactly in float64 with
Wolfe's min-norm-point active-set method and report the KKT residual. External backends
(``cvxpy``, ``qpsolvers:<name>``) exist to cross-check the built-in solver.

Everything works in each gradient's own units. With G = N C N (N the norms, C the
cosines) the solvers read C and the norms divided by the smallest, r_k >= 1; the
built-in one keeps the weights a on the simplex and takes every decision on the
contributions a_k r_k (the sizes of the terms of d = sum_k a_k r_k u_k), never on
entries of G. Why: d is no longer than the smallest gradient, and tests or solves on
G / max(diag G) cannot see products of that size beside the largest (norms 1e-5..1e6:
1e-22 against 1); plain MGDA then stopped at a point conflicting with a gradient and
reported a residual of 1e-17.

Optimality is g_k . d >= ||d||^2 for every k, with equality where a_k > 0. Each
violation is measured relative to (||g_k|| + ||d||) S, where S = sum_k a_k ||g_k|| is the
size of the terms that make d: a cosine between g_k and d when nothing cancels, and
the round-off level of the products when the terms do cancel.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mogradient._external_qp import solve_with_cvxpy, solve_with_qpsolvers
from mogradient._gram import validated_gram
from mogradient.errors import SolverError

# Sizes (norm / smallest norm) above this are capped: 2^1000, far below overflow.
_SIZE_CAP = 2.0**1000
_MAX_ITERATIONS = 1000
_EPS = float(np.finfo(np.float64).eps)
# Relative violations below this are round-off: a product u_k . d carries ~K eps of S.
_TOLERANCE = 2.0**9 * _EPS
# Support systems (unit-scaled) beyond this condition number are affinely dependent.
_MAX_CONDITION = 1e14


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
    (e.g. ``"qpsolvers:quadprog"``). ``gram`` is checked as every Gram passed in is
    (:func:`mogradient._gram.validated_gram`). A zero row (a zero gradient) puts the
    minimum at 0: such rows share the weight equally.
    """
    _check_backend(backend)
    gram = validated_gram(gram).numpy()
    if not np.all(np.isfinite(gram)):
        raise ValueError("the Gram matrix contains NaN or Inf; drop non-finite gradients first")
    norms = np.sqrt(np.diag(gram))
    zero = norms == 0
    if np.any(zero):
        weights = zero / np.count_nonzero(zero)
        return SimplexQPSolution(weights, float(weights @ gram @ weights), 0.0, backend)
    return solve_simplex_qp_factored(gram / np.outer(norms, norms), norms, backend)


def solve_simplex_qp_factored(
    cosines: np.ndarray, norms: np.ndarray, backend: str = "builtin"
) -> SimplexQPSolution:
    """The same QP for G = diag(norms) cosines diag(norms), with positive ``norms``.

    For callers that hold the Gram as cosines and norms
    (:class:`mogradient._gram.CosineGram`), whose products may not fit in float64.
    The objective is in units of ``norms`` squared.
    """
    _check_backend(backend)
    cosines = np.asarray(cosines, dtype=np.float64)
    norms = np.asarray(norms, dtype=np.float64)
    with np.errstate(over="ignore"):
        sizes = norms / norms.min()
    # A point this far out acts only through its direction (the min-norm point converges
    # as it recedes), so sizes beyond float64's range are capped; such a point may then
    # get no weight, or its weight ~ 1 / size is not representable.
    capped = ~(sizes <= _SIZE_CAP)
    sizes = np.where(capped, _SIZE_CAP, sizes)
    if backend == "builtin":
        weights = _solve_wolfe(cosines, sizes)
    else:
        weights = _solve_external(cosines, sizes, backend)
    weights = _project_to_simplex(weights)
    if np.any(weights[capped] > 0):
        raise SolverError(
            "the gradients' norms span more than float64's range and the min-norm point "
            "uses the largest ones: their weights on the raw gradients cannot be "
            "represented; rescale the objectives so that their gradients' norms lie within "
            "about 1e300 of each other"
        )
    contributions = weights * norms
    return SimplexQPSolution(
        weights=weights,
        objective=float(contributions @ cosines @ contributions),
        kkt_residual=_kkt_residual(cosines, sizes, weights),
        backend=backend,
    )


def simplex_kkt_residual(gram: np.ndarray, weights: np.ndarray) -> float:
    """Largest violation of the simplex QP's KKT conditions at ``weights``, each relative.

    At the optimum g_k . d >= ||d||^2 for every k (d = sum_k a_k g_k), with equality on
    the support of a. A violation of the first counts relative to (||g_k|| + ||d||) S,
    with S = sum_k a_k ||g_k||; one of the second is also weighted by the term's share
    a_k ||g_k|| / S; infeasibility of ``weights`` is added.
    """
    gram = np.asarray(gram, dtype=np.float64)
    weights = np.asarray(weights, dtype=np.float64)
    norms = np.sqrt(np.clip(np.diag(gram), 0.0, None))
    top = float(norms.max())
    if top == 0.0:
        return _infeasibility(weights)
    inverse = np.where(norms > 0, 1.0 / np.where(norms > 0, norms, 1.0), 0.0)
    return _kkt_residual(gram * np.outer(inverse, inverse), norms / top, weights)


def _kkt_residual(cosines: np.ndarray, sizes: np.ndarray, weights: np.ndarray) -> float:
    """:func:`simplex_kkt_residual` on cosines and sizes (norms in any common unit)."""
    contributions = weights * sizes
    total = float(contributions.sum())
    if total <= 0.0:
        return _infeasibility(weights)
    slack = _relative_slack(cosines, sizes, weights)
    descent = max(float(np.max(-slack)), 0.0)
    complementarity = float(np.max(contributions / total * np.abs(slack)))
    return max(descent, complementarity) + _infeasibility(weights)


def _relative_slack(cosines: np.ndarray, sizes: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """(g_k . d - ||d||^2) / ((||g_k|| + ||d||) S) for every k, from unit-vector products.

    Dividing u_k . d - ||d||^2 / ||g_k|| rather than forming g_k . d keeps huge and tiny
    gradients in range. A zero gradient's slack is -||d|| / S.
    """
    contributions = weights * sizes
    total = float(contributions.sum())
    if total <= 0.0:
        return np.zeros_like(sizes)
    along = cosines @ contributions
    value = max(float(contributions @ along), 0.0)
    length = float(np.sqrt(value))
    positive = sizes > 0
    safe = np.where(positive, sizes, 1.0)
    slack = np.where(positive, (along - value / safe) / (1.0 + length / safe), -length)
    return slack / total


def _infeasibility(weights: np.ndarray) -> float:
    return max(abs(float(weights.sum()) - 1.0), float(np.max(np.maximum(-weights, 0.0))))


def _check_backend(backend: str) -> None:
    if backend not in ("builtin", "cvxpy") and not backend.startswith("qpsolvers:"):
        raise ValueError(
            f"unknown QP backend {backend!r}; use 'builtin', 'cvxpy' or 'qpsolvers:<solver>'"
        )


def _solve_external(cosines: np.ndarray, sizes: np.ndarray, backend: str) -> np.ndarray:
    """Weights from an external solver, which solves for the contributions x_k = a_k r_k.

    Why: min x^T C x over x >= 0, sum_k x_k / r_k = 1 has unit scale at any spread (the
    smallest gradient alone is x = e_k, value 1), where the weights' problem on
    G / max(diag G) has products of 1e-22 that absolute tolerances cannot see.
    """
    inverse = 1.0 / sizes
    if backend == "cvxpy":
        contributions = solve_with_cvxpy(cosines, simplex=inverse)
    else:
        contributions = solve_with_qpsolvers(cosines, backend.split(":", 1)[1], simplex=inverse)
    return contributions * inverse


def _project_to_simplex(weights: np.ndarray) -> np.ndarray:
    """Remove solver round-off (tiny negatives, sum off by 1e-12) without moving the optimum."""
    weights = np.maximum(np.asarray(weights, dtype=np.float64).reshape(-1), 0.0)
    total = weights.sum()
    if not np.isfinite(total) or total <= 0:
        raise SolverError("QP backend returned no usable solution")
    return weights / total


def _solve_wolfe(cosines: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Wolfe's (1976) min-norm-point algorithm on the points r_k u_k.

    Keeps a corral (affinely independent support). Major cycle: add the point whose
    optimality condition is most violated; minor cycles: move to the affine minimizer
    of the corral, dropping points whose weights would turn negative.
    """
    count = len(sizes)
    start = int(np.argmin(sizes))
    support = [start]
    weights = np.zeros(count)
    weights[start] = 1.0
    for _ in range(_MAX_ITERATIONS):
        violations = -_relative_slack(cosines, sizes, weights)
        candidate = int(np.argmax(violations))
        if candidate in support or violations[candidate] <= _TOLERANCE:
            break
        moved = _minor_cycles(cosines, sizes, weights, [*support, candidate])
        if moved is None:
            break  # the candidate is affinely dependent on the corral at this precision
        weights, support = moved
        if candidate not in support:
            break  # the violated point could not get weight: no progress at this precision
    return _polish(cosines, sizes, weights)


def _minor_cycles(
    cosines: np.ndarray, sizes: np.ndarray, weights: np.ndarray, support: list[int]
) -> tuple[np.ndarray, list[int]] | None:
    """Move towards the support's affine minimizer, dropping points whose weight reaches
    zero, until the minimizer is inside the simplex; None if the support is dependent."""
    weights = weights.copy()
    while True:
        affine = _affine_minimizer(cosines, sizes, support)
        if affine is None:
            return None
        sizes_here = sizes[support]
        significant = _significant(affine, sizes_here)
        if np.all(significant):
            weights[:] = 0.0
            weights[support] = affine
            return weights, support
        current = weights[support]
        blocking = ~significant & (affine < current)
        gaps = np.where(blocking, current - affine, 1.0)
        ratios = np.where(blocking, current / gaps, np.inf)
        step = float(np.clip(np.min(ratios), 0.0, 1.0))
        moved = current + step * (affine - current)
        keep = _significant(moved, sizes_here)
        if not np.any(keep):
            keep[int(np.argmax(moved * sizes_here))] = True
        weights[:] = 0.0
        support = [index for index, kept in zip(support, keep, strict=True) if kept]
        weights[support] = moved[keep] / moved[keep].sum()


def _significant(weights: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Points whose contribution a_k r_k is positive beyond round-off of the total size."""
    contributions = weights * sizes
    return contributions > _TOLERANCE * float(np.abs(contributions).sum())


def _affine_minimizer(
    cosines: np.ndarray, sizes: np.ndarray, support: list[int]
) -> np.ndarray | None:
    """Weights (summing to one) of the min-norm point of the support's affine hull.

    Solved for the contributions x_k = a_k r_k / min r, unit-scaled: C x + lambda w = 0,
    w . x = 1 with w_k = min r / r_k in (0, 1]; then a_k = x_k w_k.
    """
    inverse = 1.0 / sizes[support]
    inverse = inverse / inverse.max()
    size = len(support)
    system = np.zeros((size + 1, size + 1))
    system[:size, :size] = cosines[np.ix_(support, support)]
    system[:size, size] = inverse
    system[size, :size] = inverse
    rhs = np.zeros(size + 1)
    rhs[size] = 1.0
    if np.linalg.cond(system) > _MAX_CONDITION:
        return None
    return np.linalg.solve(system, rhs)[:size] * inverse


def _polish(cosines: np.ndarray, sizes: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Re-solve the KKT system on the final support to remove accumulated round-off."""
    support = [int(index) for index in np.flatnonzero(weights > 0)]
    affine = _affine_minimizer(cosines, sizes, support)
    if affine is None or np.any(affine < 0):
        return weights
    polished = np.zeros_like(weights)
    polished[support] = affine
    if _squared_norm(cosines, sizes, polished) <= _squared_norm(cosines, sizes, weights):
        return polished
    return weights


def _squared_norm(cosines: np.ndarray, sizes: np.ndarray, weights: np.ndarray) -> float:
    contributions = weights * sizes
    return float(contributions @ cosines @ contributions)
