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

A floor (``floor=f``: min a^T G a over {sum a = 1, a_k >= f}, MARBLE's ``alpha_floor``) is
solved exactly by substitution: a = f 1 + s b with s = 1 - K f and b on the simplex, so
a^T G a = s^2 (b^T G b + c^T b) + const with c = (2 f / s) G 1, a simplex QP with a linear
term. On the simplex (1^T b = 1) a linear term is a quadratic one, c^T b = b^T (c 1^T +
1 c^T) b / 2, and adding t^2 (1^T G 1) 1 1^T (t = f / s; a constant there) makes it the
Gram of the points g_k + t sum_j g_j: the floored problem is the min-norm point of the
hull of those shifted points, with weights b, and d = sum_k a_k g_k = s (that point). The
built-in solver runs Wolfe's method on the shifted points without forming their Gram
(whose t^2 term would swamp the hull's own size as f K -> 1): every product it takes is
of a g_k with d, and its affine minimizers carry the linear term on their right-hand
side. Optimality becomes g_k . d >= e . d (e = sum_k b_k g_k), with equality where
a_k > f, measured relative to (||g_k|| + ||e||) sum_k a_k ||g_k||; f = 0 is the problem
above, arithmetic included.
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
# A floored problem with 1 - K f below this times K has one feasible point to round-off.
_UNIFORM_SCALE = 4 * _EPS


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
    (`mogradient._gram.validated_gram`). A zero row (a zero gradient) puts the
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
    cosines: np.ndarray, norms: np.ndarray, backend: str = "builtin", floor: float = 0.0
) -> SimplexQPSolution:
    """The same QP for G = diag(norms) cosines diag(norms), with positive ``norms``.

    For callers that hold the Gram as cosines and norms
    ([`mogradient.harmonizers.CosineGram`][mogradient.harmonizers.CosineGram]), whose products may
    not fit in float64. The objective is in units of ``norms`` squared.

    ``floor`` f in [0, 1/K] bounds every weight from below inside the QP (min a^T G a over
    {sum a = 1, a >= f}; the module docstring says how it is solved). f = 1/K leaves one
    feasible point, the uniform weights. External backends solve the equivalent problem on
    the shifted points' Gram, which loses digits as f K -> 1 (a cross-check only).
    """
    _check_backend(backend)
    cosines = np.asarray(cosines, dtype=np.float64)
    norms = np.asarray(norms, dtype=np.float64)
    floor = _checked_floor(floor, len(norms))
    if floor > 0.0:
        return _solve_floored(cosines, norms, backend, floor)
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


def simplex_kkt_residual(gram: np.ndarray, weights: np.ndarray, floor: float = 0.0) -> float:
    """Largest violation of the simplex QP's KKT conditions at ``weights``, each relative.

    At the optimum g_k . d >= ||d||^2 for every k (d = sum_k a_k g_k), with equality on
    the support of a. A violation of the first counts relative to (||g_k|| + ||d||) S,
    with S = sum_k a_k ||g_k||; one of the second is also weighted by the term's share
    a_k ||g_k|| / S; infeasibility of ``weights`` is added.

    With ``floor`` f > 0 (weights a >= f): g_k . d >= e . d with e = sum_k b_k g_k and
    b = (a - f) / (1 - K f), equality where a_k > f, relative to (||g_k|| + ||e||) S; the
    share is b_k ||g_k|| / sum_k (b_k + t) ||g_k||, t = f / (1 - K f). At f = 1/K only the
    distance from the uniform weights counts.
    """
    gram = np.asarray(gram, dtype=np.float64)
    weights = np.asarray(weights, dtype=np.float64)
    count = len(weights)
    floor = _checked_floor(floor, count)
    scale = 1.0 - count * floor
    if floor > 0.0 and scale <= _UNIFORM_SCALE * count:
        return _infeasibility(weights, np.full(count, 1.0 / count))
    shift = floor / scale if floor > 0.0 else 0.0
    excess = (weights - floor) / scale if floor > 0.0 else weights
    norms = np.sqrt(np.clip(np.diag(gram), 0.0, None))
    top = float(norms.max())
    if top == 0.0:
        return _infeasibility(excess)
    inverse = np.where(norms > 0, 1.0 / np.where(norms > 0, norms, 1.0), 0.0)
    return _kkt_residual(gram * np.outer(inverse, inverse), norms / top, excess, shift)


def _kkt_residual(
    cosines: np.ndarray, sizes: np.ndarray, weights: np.ndarray, shift: float = 0.0
) -> float:
    """`simplex_kkt_residual` on cosines and sizes (norms in any common unit); with
    ``shift`` t = f / (1 - K f) > 0, ``weights`` are the b of a floored problem."""
    contributions = weights * sizes
    total = float(contributions.sum())
    if shift:
        total += shift * float(sizes.sum())
    if total <= 0.0:
        return _infeasibility(weights)
    slack = _relative_slack(cosines, sizes, weights, shift)
    descent = max(float(np.max(-slack)), 0.0)
    complementarity = float(np.max(contributions / total * np.abs(slack)))
    return max(descent, complementarity) + _infeasibility(weights)


def _relative_slack(
    cosines: np.ndarray, sizes: np.ndarray, weights: np.ndarray, shift: float = 0.0
) -> np.ndarray:
    """(g_k . d - ||d||^2) / ((||g_k|| + ||d||) S) for every k, from unit-vector products.

    Dividing u_k . d - ||d||^2 / ||g_k|| rather than forming g_k . d keeps huge and tiny
    gradients in range. A zero gradient's slack is -||d|| / S.

    With ``shift`` t > 0 (a floored problem, ``weights`` its b): d = sum_k (b_k + t) g_k,
    and the slack is (g_k . d - e . d) / ((||g_k|| + ||e||) S) with e = sum_k b_k g_k and
    S = sum_k (b_k + t) ||g_k||: its round-off stays ~eps at any t.
    """
    contributions = weights * sizes
    terms = contributions + shift * sizes if shift else contributions
    total = float(terms.sum())
    if total <= 0.0:
        return np.zeros_like(sizes)
    along = cosines @ terms
    if shift:
        value = float(contributions @ along)
        length = float(np.sqrt(max(float(contributions @ cosines @ contributions), 0.0)))
        zero = -value / length if length > 0.0 else 0.0
    else:
        value = max(float(contributions @ along), 0.0)
        length = float(np.sqrt(value))
        zero = -length
    positive = sizes > 0
    safe = np.where(positive, sizes, 1.0)
    slack = np.where(positive, (along - value / safe) / (1.0 + length / safe), zero)
    return slack / total


def _infeasibility(weights: np.ndarray, target: np.ndarray | None = None) -> float:
    """How far ``weights`` are off the simplex (or, given, from its one ``target`` point)."""
    if target is not None:
        return float(np.max(np.abs(weights - target)))
    return max(abs(float(weights.sum()) - 1.0), float(np.max(np.maximum(-weights, 0.0))))


def _checked_floor(floor: float, count: int) -> float:
    """``floor`` as a float in [0, 1/count] (1/count to round-off), else a ValueError."""
    floor = float(floor)
    if not (np.isfinite(floor) and floor >= 0.0 and floor * count <= 1.0 + 4 * count * _EPS):
        raise ValueError(f"floor must be in [0, 1/K] = [0, {1.0 / count:g}], got {floor}")
    return floor


def _solve_floored(
    cosines: np.ndarray, norms: np.ndarray, backend: str, floor: float
) -> SimplexQPSolution:
    """min a^T G a over {sum a = 1, a >= floor} as the simplex QP in b (a = floor + s b)."""
    count = len(norms)
    scale = 1.0 - count * floor
    if scale <= _UNIFORM_SCALE * count:
        # One feasible point (to round-off): the uniform weights, optimal by definition.
        weights = np.full(count, 1.0 / count)
        contributions = weights * norms
        objective = float(contributions @ cosines @ contributions)
        return SimplexQPSolution(weights, objective, 0.0, backend)
    shift = floor / scale
    with np.errstate(over="ignore"):
        sizes = norms / norms.min()
    if not np.all(sizes <= _SIZE_CAP):
        raise SolverError(
            "the gradients' norms span more than float64's range and a floor gives each "
            "of them weight: rescale the objectives so that their gradients' norms lie "
            "within about 1e300 of each other"
        )
    if backend == "builtin":
        excess = _solve_wolfe(cosines, sizes, shift)
    else:
        excess = _solve_shifted_external(cosines, sizes, shift, backend)
    excess = _project_to_simplex(excess)
    weights = floor + scale * excess
    contributions = weights * norms
    return SimplexQPSolution(
        weights=weights,
        objective=float(contributions @ cosines @ contributions),
        kkt_residual=_kkt_residual(cosines, sizes, excess, shift),
        backend=backend,
    )


def _solve_shifted_external(
    cosines: np.ndarray, sizes: np.ndarray, shift: float, backend: str
) -> np.ndarray:
    """b from an external solver on the Gram of the shifted points g_k + t sum_j g_j."""
    units = sizes / sizes.max()
    cross = units * (cosines @ units)
    gram = (
        np.outer(units, units) * cosines
        + shift * (cross[:, None] + cross[None, :])
        + shift**2 * float(cross.sum())
    )
    lengths = np.sqrt(np.clip(np.diag(gram), 0.0, None))
    if np.any(lengths == 0.0):
        return (lengths == 0.0) / np.count_nonzero(lengths == 0.0)
    shifted = np.clip(gram / np.outer(lengths, lengths), -1.0, 1.0)
    np.fill_diagonal(shifted, 1.0)
    return _solve_external(shifted, lengths / lengths.min(), backend)


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


def _solve_wolfe(cosines: np.ndarray, sizes: np.ndarray, shift: float = 0.0) -> np.ndarray:
    """Wolfe's (1976) min-norm-point algorithm on the points r_k u_k (each shifted by
    t sum_j r_j u_j for ``shift`` t > 0: then the weights are a floored problem's b).

    Keeps a corral (affinely independent support). Major cycle: add the point whose
    optimality condition is most violated; minor cycles: move to the affine minimizer
    of the corral, dropping points whose weights would turn negative.
    """
    count = len(sizes)
    if shift:
        start = int(np.argmin(sizes * (sizes + 2 * shift * (cosines @ sizes))))
    else:
        start = int(np.argmin(sizes))
    support = [start]
    weights = np.zeros(count)
    weights[start] = 1.0
    for _ in range(_MAX_ITERATIONS):
        violations = -_relative_slack(cosines, sizes, weights, shift)
        candidate = int(np.argmax(violations))
        if candidate in support or violations[candidate] <= _TOLERANCE:
            break
        moved = _minor_cycles(cosines, sizes, weights, [*support, candidate], shift)
        if moved is None:
            break  # the candidate is affinely dependent on the corral at this precision
        weights, support = moved
        if candidate not in support:
            break  # the violated point could not get weight: no progress at this precision
    return _polish(cosines, sizes, weights, shift)


def _minor_cycles(
    cosines: np.ndarray,
    sizes: np.ndarray,
    weights: np.ndarray,
    support: list[int],
    shift: float = 0.0,
) -> tuple[np.ndarray, list[int]] | None:
    """Move towards the support's affine minimizer, dropping points whose weight reaches
    zero, until the minimizer is inside the simplex; None if the support is dependent."""
    weights = weights.copy()
    while True:
        affine = _affine_minimizer(cosines, sizes, support, shift)
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
    cosines: np.ndarray, sizes: np.ndarray, support: list[int], shift: float = 0.0
) -> np.ndarray | None:
    """Weights (summing to one) of the min-norm point of the support's affine hull.

    Solved for the contributions x_k = a_k r_k / min r, unit-scaled: C x + lambda w = 0,
    w . x = 1 with w_k = min r / r_k in (0, 1]; then a_k = x_k w_k. With ``shift`` t the
    linear term goes to the right-hand side: C x + lambda w = -(t / min r) (C r)_support.
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
    if shift:
        rhs[:size] = -(shift / float(sizes[support].min())) * (cosines[support] @ sizes)
    if np.linalg.cond(system) > _MAX_CONDITION:
        return None
    return np.linalg.solve(system, rhs)[:size] * inverse


def _polish(
    cosines: np.ndarray, sizes: np.ndarray, weights: np.ndarray, shift: float = 0.0
) -> np.ndarray:
    """Re-solve the KKT system on the final support to remove accumulated round-off."""
    support = [int(index) for index in np.flatnonzero(weights > 0)]
    affine = _affine_minimizer(cosines, sizes, support, shift)
    if affine is None or np.any(affine < 0):
        return weights
    polished = np.zeros_like(weights)
    polished[support] = affine
    if _objective(cosines, sizes, polished, shift) <= _objective(cosines, sizes, weights, shift):
        return polished
    return weights


def _objective(
    cosines: np.ndarray, sizes: np.ndarray, weights: np.ndarray, shift: float = 0.0
) -> float:
    """||sum_k a_k r_k u_k||^2, plus a floored problem's linear term 2 t (G 1) . b."""
    contributions = weights * sizes
    value = float(contributions @ cosines @ contributions)
    if shift:
        value += 2 * shift * float(sizes @ cosines @ contributions)
    return value
