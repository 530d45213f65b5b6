"""Exact dual-cone projection: min_v v^T G v subject to v >= lower (G PSD, maybe singular).

This is the QP inside UPGrad and DualProj. With G = J J^T, its solution v gives the
projection of J^T lower onto the dual cone {d : J d >= 0} as d = J^T v (Quinton & Rey
2024, Prop. 1). We solve it exactly in float64 and report a KKT residual; ``cvxpy`` and
``qpsolvers:<name>`` backends exist to cross-check.

UPGrad needs K of these QPs on one Gram: `solve_cone_qps_factored` factors it once
and solves them all together (`mogradient._batched_cone`, normal equations, each
answer certified by its KKT residual), and only the ones it cannot certify one by one.

The one-by-one solver never forms normal equations, which square the condition number
and fail on near-dependent gradients (an opposed pair, near duplicates). It works in
the span of the gradients: a square root A of the unit-diagonal Gram (A^T A = cosines,
from its eigen-decomposition) stands in for J, Lawson & Hanson's NNLS runs on A with
SVD least squares, and the projection itself is an orthogonal residual, accurate
however large the multipliers get. Near-dependent gradients can make every v >= lower
huge while the projection is small; then the weights returned are the min-norm ones
that give the same projection, so that J^T v carries no cancellation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mogradient._batched_cone import project_all
from mogradient._external_qp import solve_with_cvxpy, solve_with_qpsolvers
from mogradient._gram import validated_gram
from mogradient._span import coordinates_from_cosines

_TOLERANCE = 1e-13
# A violated constraint must exceed this many units of round-off in A^T y (|y| <= |point|).
_VIOLATION_TOLERANCE = 64 * np.finfo(float).eps
# Passive columns whose smallest singular value is below this of the largest are dependent
# (Gram square roots); coordinates from the stack's QR resolve down to the second x K.
_RANK_TOLERANCE = 1e-10
_STACK_RANK_TOLERANCE = 64 * np.finfo(float).eps
# Weights v >= lower are returned unless they exceed the min-norm ones this many times.
_CANCELLATION_LIMIT = 1e3
# Relative round-off of a residual's norm computed by an orthogonal projection.
_NORM_ROUND_OFF = 16 * np.finfo(float).eps
# Below this smallest/largest cosine-matrix eigenvalue, solves are redone on the stack.
_REFINE_BELOW = 1e-6


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
    ``"qpsolvers:<solver>"``. ``gram`` is checked as every Gram passed in is
    (`mogradient._gram.validated_gram`). The built-in solver works in the span
    coordinates of the cosine matrix C = D^-1 G D^-1 (D = diag(||g_k||)), which stays
    well-conditioned when the gradients' norms differ by many orders of magnitude; the
    external backends get G / max(diag G) and lower / max|lower|. Results do not depend
    on overall scales. When ``gram`` is singular ``v`` need not be unique, but ``J^T v``
    (the projection) is; the built-in solver returns v >= lower unless every such v
    cancels (is 1000x larger than the min-norm weights giving the same projection), and
    then the min-norm weights, which may fall below ``lower``. Objectives with a zero row
    keep ``v_k = lower_k``.
    """
    gram = validated_gram(gram).numpy()
    lower = np.asarray(lower, dtype=np.float64).reshape(-1)
    if lower.shape != (gram.shape[0],):
        raise ValueError(
            f"lower must have one entry per objective ({gram.shape[0]}), got shape {lower.shape}"
        )
    if not (np.all(np.isfinite(gram)) and np.all(np.isfinite(lower))):
        raise ValueError("the Gram matrix and lower bound must be finite")
    norms = np.sqrt(np.diag(gram))
    inverse = np.where(norms > 0, 1.0 / np.where(norms > 0, norms, 1.0), 0.0)
    return solve_cone_qp_factored(gram * np.outer(inverse, inverse), norms, lower, backend)


def solve_cone_qp_factored(
    cosines: np.ndarray, norms: np.ndarray, lower: np.ndarray, backend: str = "builtin"
) -> ConeQPSolution:
    """The same QP for G = diag(norms) cosines diag(norms) (norms >= 0; a zero norm's
    cosines are ignored), for callers that hold the Gram as cosines and norms
    ([`mogradient.harmonizers.CosineGram`][mogradient.harmonizers.CosineGram]). The objective is in
    units of ``norms`` squared.
    """
    lower = np.asarray(lower, dtype=np.float64)
    return solve_cone_qps_factored(cosines, norms, lower[None, :], backend)[0]


def solve_cone_qps_factored(
    cosines: np.ndarray, norms: np.ndarray, lowers: np.ndarray, backend: str = "builtin"
) -> list[ConeQPSolution]:
    """`solve_cone_qp_factored` for every row of ``lowers`` (m x K), one per QP.

    Why together: the built-in solver factors the cosines once and solves all the QPs at
    once (`mogradient._batched_cone.project_all`), each answer certified by its KKT
    residual; the few it cannot certify are solved one by one, exactly as alone.
    """
    cosines = np.asarray(cosines, dtype=np.float64)
    norms = np.asarray(norms, dtype=np.float64)
    lowers = np.asarray(lowers, dtype=np.float64)
    if backend not in ("builtin", "cvxpy") and not backend.startswith("qpsolvers:"):
        raise ValueError(
            f"unknown QP backend {backend!r}; use 'builtin', 'cvxpy' or 'qpsolvers:<solver>'"
        )
    top = float(np.max(norms))
    lower_scales = np.max(np.abs(lowers), axis=1)
    solutions: list[ConeQPSolution | None] = [None] * len(lowers)
    solvable = np.flatnonzero(lower_scales > 0) if top > 0 else np.array([], dtype=int)
    sizes = norms / top if top > 0 else norms
    normalized = lowers[solvable] / lower_scales[solvable, None]
    if backend == "builtin":
        solved = _solve_builtin_many(cosines, sizes, normalized)
    else:
        solved = [_solve_external(cosines, sizes, lower, backend) for lower in normalized]
    for index, lower, (weights, residual) in zip(solvable, normalized, solved, strict=True):
        bounded = bool(np.all(weights >= lower))
        weights = weights * lower_scales[index]
        if bounded:
            weights = np.maximum(weights, lowers[index])  # rescaling round-off must not cross
        solutions[index] = ConeQPSolution(
            weights, _objective(cosines, norms, weights), residual, backend
        )
    for index, lower in enumerate(lowers):
        if solutions[index] is None:
            # Every feasible v (in particular v = lower) is optimal, or v = lower = 0.
            solutions[index] = ConeQPSolution(
                lower.copy(), _objective(cosines, norms, lower), 0.0, backend
            )
    return solutions


def _solve_external(
    cosines: np.ndarray, sizes: np.ndarray, lower: np.ndarray, backend: str
) -> tuple[np.ndarray, float]:
    """Weights from cvxpy or qpsolvers on G / max(diag G), and their KKT residual."""
    normalized_gram = cosines * np.outer(sizes, sizes)
    if backend == "cvxpy":
        weights = solve_with_cvxpy(normalized_gram, lower)
    else:
        weights = solve_with_qpsolvers(normalized_gram, backend.split(":", 1)[1], lower)
    # Solver round-off may leave v a hair below the bound; clipping only moves it inward.
    weights = np.maximum(weights, lower)
    return weights, cone_kkt_residual(normalized_gram, lower, weights)


def _objective(cosines: np.ndarray, norms: np.ndarray, weights: np.ndarray) -> float:
    contributions = weights * norms
    return float(contributions @ cosines @ contributions)


def near_dependent(gram: np.ndarray) -> bool:
    """Whether the gradients are close enough to dependent that the Gram-only solve may
    lose digits (smallest cosine-matrix eigenvalue below ``_REFINE_BELOW`` of the largest)."""
    gram = np.asarray(gram, dtype=np.float64)
    norms = np.sqrt(np.clip(np.diag(gram), 0.0, None))
    if len(gram) < 2 or not np.all(norms > 0):
        return False
    eigenvalues = np.linalg.eigvalsh(gram / np.outer(norms, norms))
    return bool(eigenvalues[0] < _REFINE_BELOW * eigenvalues[-1])


def project_in_span(
    coordinates: np.ndarray, norms: np.ndarray, lower: np.ndarray
) -> tuple[np.ndarray, np.ndarray, float]:
    """The dual-cone projection of J^T lower, in exact span coordinates of the stack.

    ``coordinates`` (r x K) and ``norms`` come from
    `mogradient._span.coordinates_from_stack` (unit rows^T = Q R): the same
    active-set method as the Gram path, on R instead of a Gram square root, so
    near-dependent gradients lose nothing. Returns weights v >= lower (possibly large:
    they cancel), the projection's coordinates y (d = Q y, formed without that
    cancellation), and the KKT residual.
    """
    target = np.asarray(lower, dtype=np.float64) * norms
    point = coordinates @ target
    # R from a Householder QR is exact to ~eps of its size: angles between gradients
    # down to ~1e-13 are real here, where the Gram path cannot resolve below ~1e-8.
    rank_tolerance = _STACK_RANK_TOLERANCE * len(norms)
    multipliers, projection = _nonnegative_least_squares(coordinates, point, rank_tolerance)
    if float(np.linalg.norm(point)) == 0.0:
        return np.asarray(lower, dtype=np.float64).copy(), projection, 0.0
    residual = _projection_residual(coordinates, point, multipliers, projection)
    return (target + multipliers) / norms, projection, residual


def project_many_in_span(
    coordinates: np.ndarray, norms: np.ndarray, lowers: np.ndarray
) -> list[tuple[np.ndarray, np.ndarray, float]]:
    """`project_in_span` for every row of ``lowers`` (m x K): all at once on the
    stack's R (`mogradient._batched_cone.project_all`), the uncertified one by one."""
    lowers = np.asarray(lowers, dtype=np.float64)
    targets = lowers * norms
    batch = project_all(torch.from_numpy(coordinates), torch.from_numpy(targets))
    results = []
    for index, lower in enumerate(lowers):
        if not batch.certified[index]:
            results.append(project_in_span(coordinates, norms, lower))
            continue
        bounded = targets[index] + batch.multipliers[index].numpy()
        residual = float(batch.residuals[index])
        results.append((np.maximum(bounded / norms, lower), coordinates @ bounded, residual))
    return results


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


def _solve_builtin_many(
    cosines: np.ndarray, norms: np.ndarray, lowers: np.ndarray
) -> list[tuple[np.ndarray, float]]:
    """`_solve_builtin` for every row of ``lowers``: one factor, all QPs at once, the
    uncertified ones one by one."""
    rows = norms > 0
    if not np.any(rows) or len(lowers) == 0:
        return [(lower.copy(), 0.0) for lower in lowers]
    factor = coordinates_from_cosines(cosines[np.ix_(rows, rows)])
    targets = lowers[:, rows] * norms[rows]
    batch = project_all(torch.from_numpy(factor), torch.from_numpy(targets))
    chosen = targets + batch.multipliers.numpy()
    weights = lowers.copy()
    weights[:, rows] = chosen / norms[rows]
    weights = np.maximum(weights, lowers)
    # (G w)_k / ||g_k|| = sum_j cos_kj ||g_j|| w_j, over ||J^T lower||: as _solve_builtin.
    sizes = np.linalg.norm(targets @ factor.T, axis=1)
    conflicts = np.max(-((weights * norms) @ cosines[rows].T), axis=1)
    conflicts = np.divide(conflicts, sizes, out=np.full_like(sizes, np.inf), where=sizes > 0)
    residuals = np.maximum(batch.residuals.numpy(), conflicts)
    return [
        (weights[index], max(float(residuals[index]), 0.0))
        if batch.certified[index]
        else _solve_builtin(cosines, norms, lowers[index], factor)
        for index in range(len(lowers))
    ]


def _solve_builtin(
    cosines: np.ndarray, norms: np.ndarray, lower: np.ndarray, factor: np.ndarray | None = None
) -> tuple[np.ndarray, float]:
    """Weights giving the projection J^T v*, and the KKT residual of the solve.

    ``factor`` is `coordinates_from_cosines` of the rows with positive norms, when
    the caller has it. The residual is measured where it is accurate: projection
    optimality in the span coordinates (see `_projection_residual`), and the
    conflict cosines -(G w)_k / (||g_k|| ||J^T lower||) of the weights actually returned.
    """
    rows = norms > 0
    weights = lower.copy()
    if not np.any(rows):
        return weights, 0.0
    if factor is None:
        factor = coordinates_from_cosines(cosines[np.ix_(rows, rows)])
    target = lower[rows] * norms[rows]
    point = factor @ target
    multipliers, projection = _nonnegative_least_squares(factor, point)
    bounded = target + multipliers
    # v >= lower is the textbook answer; keep it unless it is the cancelling kind, i.e.
    # over 1000x the min-norm weights giving the same projection (computed only then).
    chosen = bounded
    if float(np.max(np.abs(bounded))) > _CANCELLATION_LIMIT * float(np.max(np.abs(target))):
        minimal = np.linalg.lstsq(factor, projection, rcond=None)[0]
        largest = max(float(np.max(np.abs(minimal))), float(np.max(np.abs(target))))
        if float(np.max(np.abs(bounded))) > _CANCELLATION_LIMIT * largest:
            chosen = minimal
    weights[rows] = chosen / norms[rows]
    if chosen is bounded:
        weights = np.maximum(weights, lower)
    size = float(np.linalg.norm(point))
    if size == 0.0:
        return weights, 0.0
    # (G w)_k / ||g_k|| = sum_j cos_kj ||g_j|| w_j: no product of two norms is formed.
    conflict = -(cosines[rows] @ (weights * norms)) / size
    residual = max(
        _projection_residual(factor, point, multipliers, projection), float(np.max(conflict))
    )
    return weights, max(residual, 0.0)


def _projection_residual(
    factor: np.ndarray, point: np.ndarray, multipliers: np.ndarray, projection: np.ndarray
) -> float:
    """KKT of projecting ``point`` onto {y : A^T y >= 0}, relative to the sizes involved.

    y is the projection iff A^T y >= 0, y = point + A x with x >= 0, and x_k a_k.y = 0.
    Stationarity and complementarity are relative to ||point|| + sum_k x_k ||a_k||: large
    multipliers (near-dependent gradients) cost eps of that much in any arithmetic.
    """
    size = float(np.linalg.norm(point))
    inner = factor.T @ projection
    column_norms = np.linalg.norm(factor, axis=0)
    dual = float(np.max(-inner / np.maximum(column_norms, np.finfo(float).tiny))) / size
    magnitude = size + float(multipliers @ column_norms)
    stationarity = float(np.linalg.norm(point + factor @ multipliers - projection)) / magnitude
    complementarity = float(np.max(np.abs(multipliers * inner))) / (size * magnitude)
    return max(dual, stationarity, complementarity, 0.0)


def _nonnegative_least_squares(
    factor: np.ndarray, point: np.ndarray, rank_tolerance: float = _RANK_TOLERANCE
) -> tuple[np.ndarray, np.ndarray]:
    """Lawson & Hanson (1974): min ||point + A x|| over x >= 0; returns x and the residual.

    The residual is the projection of ``point`` onto the cone {y : A^T y >= 0}. On the
    passive set P the least-squares problem is solved by SVD and the residual taken as
    ``point`` minus its orthogonal projection onto span(A_P), never as ``point + A_P x_P``
    (which cancels when x is large). A column whose entry would leave A_P rank-deficient
    (smallest singular value below ``rank_tolerance`` of the largest) is excluded; the
    loop also stops when round-off stops progress.
    """
    num = factor.shape[1]
    size = float(np.linalg.norm(point))
    multipliers = np.zeros(num)
    residual = point.copy()
    if size == 0.0 or factor.shape[0] == 0:
        return multipliers, residual
    passive = np.zeros(num, dtype=bool)
    excluded = np.zeros(num, dtype=bool)
    column_norms = np.linalg.norm(factor, axis=0)
    for _ in range(10 * num + 20):
        violation = -(factor.T @ residual)
        noise = _VIOLATION_TOLERANCE * size * np.maximum(column_norms, 1.0)
        candidates = ~passive & ~excluded & (violation > noise)
        if not np.any(candidates):
            break
        entering = int(np.argmax(np.where(candidates, violation, -np.inf)))
        previous = (multipliers.copy(), residual.copy(), passive.copy())
        passive[entering] = True
        for _ in range(10 * num + 20):
            solved = _passive_least_squares(factor[:, passive], point, rank_tolerance)
            if solved is None:
                passive[entering] = False
                excluded[entering] = True
                break
            coefficients, trial_residual = solved
            trial = np.zeros(num)
            trial[passive] = coefficients
            if np.all(coefficients > 0.0):
                multipliers, residual = trial, trial_residual
                break
            blocking = passive & (trial <= 0.0)
            ratios = multipliers[blocking] / (multipliers[blocking] - trial[blocking])
            multipliers = multipliers + float(np.min(ratios)) * (trial - multipliers)
            passive &= multipliers > _TOLERANCE * max(1.0, float(np.max(multipliers)))
            multipliers[~passive] = 0.0
            if not passive[entering]:
                excluded[entering] = True
                break
            if not np.any(passive):
                residual = point.copy()
                break
        before, after = np.linalg.norm(previous[1]), np.linalg.norm(residual)
        # A constraint violated by v shortens the residual only by ~v^2 (below eps for
        # v ~ 1e-8) while turning it by ~v: only growth beyond round-off means no progress.
        if after > before * (1.0 + _NORM_ROUND_OFF):
            multipliers, residual, passive = previous
            break
        if after < before:
            excluded[:] = False
    return multipliers, residual


def _passive_least_squares(
    columns: np.ndarray, point: np.ndarray, rank_tolerance: float
) -> tuple[np.ndarray, np.ndarray] | None:
    """x minimizing ||point + C x|| and the residual; None when C is numerically rank-deficient."""
    left, singular, right = np.linalg.svd(columns, full_matrices=False)
    if singular[-1] <= rank_tolerance * singular[0]:
        return None
    along = left.T @ point
    coefficients = -(right.T @ (along / singular))
    return coefficients, point - left @ along
