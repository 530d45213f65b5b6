"""CAGrad: the best worst-case improvement within a ball around the mean gradient."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from mogradient._gram import CosineGram
from mogradient._qp_cone import near_dependent
from mogradient._span import coordinates_from_cosines, coordinates_from_stack
from mogradient.harmonizers._base import Harmonizer, WeighResult, validated_flag
from mogradient.harmonizers.promises import LINEAR_UNDER_SCALING, PERMUTATION_INVARIANT

_MAX_ITERATIONS = 200
_EPS = float(np.finfo(np.float64).eps)
# A constraint g_k . d >= mu counts as violated beyond this fraction of the size of its
# terms, |mu| + ||g_k|| (||g0|| + s): relative to each gradient's own size at any spread.
_TOLERANCE = 1e-12
# Eigenvalues of the cosine matrix below this x K x the largest are round-off.
# Unit-scaled differences of support points whose singular values are below this of the
# largest are dependent (the support is affinely dependent in that direction).
_RANK_TOLERANCE = 1e-10


class CAGrad(Harmonizer):
    """Conflict-averse gradient descent (Liu et al. 2021, Conflict-Averse Gradient Descent).

    CAGrad maximizes min_k g_k . d over the ball ||d - g0|| <= c ||g0|| (g0 the mean
    gradient). Its dual is min over the simplex of F(w) = g_w . g0 + s ||g_w|| with
    g_w = J^T w and s = c ||g0||, and then d = g0 + (s / ||g_w||) g_w, i.e. raw weights
    1/K + (s / ||g_w||) w (paper's Algorithm 1, and TorchJD).

    We solve the dual exactly with Wolfe's active-set method applied to F (F is convex,
    so the min-norm method's corral argument carries over). On a support S the minimizer
    of F over its affine hull is closed-form: with m the min-norm point of aff(g_S) and
    h the projection of g0 on the span of the differences, g_w = m - lam h where
    lam = ||m|| / sqrt(s^2 - ||h||^2) (F decreases without bound along -h when
    s <= ||h||). Everything is computed on explicit coordinates of the gradients in their
    span, with rank decisions made on unit-scaled vectors and every optimality test
    relative to the sizes of the terms involved, so gradients whose norms span 1e-16..1e16
    are handled exactly: the answer then hinges on the smallest ones, in their own units.
    The coordinates come from the cosine matrix (Gram path) or, when the Gram says the
    gradients are near-dependent, from a QR factorization of the stack itself, which keeps
    what the Gram loses (``refine``; the direction is then formed in those coordinates).

    ``kkt_residual`` is the largest violation of the primal optimality conditions
    g_k . d >= mu (equality on the support), each relative to the size of its terms,
    |mu| + ||g_k|| (||g0|| + s).

    ``rescale=True`` divides the direction by 1 + c^2, the authors' code default (not in
    the paper). If 0 is in the convex hull of the gradients and c >= 1 the direction is
    zero (``fallback="pareto_stationary"``); if g0 is zero it is g0.
    """

    promises: ClassVar[frozenset[str]] = frozenset({PERMUTATION_INVARIANT, LINEAR_UNDER_SCALING})
    fallbacks: ClassVar[frozenset[str]] = frozenset({"pareto_stationary"})

    def __init__(self, c: float = 0.5, rescale: bool = False) -> None:
        if not (math.isfinite(c) and c >= 0):
            raise ValueError(f"c must be a finite non-negative number, got {c}")
        self.c = float(c)
        self.rescale = validated_flag(rescale, "rescale")

    def weigh(self, gram: CosineGram, objectives: torch.Tensor) -> WeighResult:
        sizes = gram.norms.numpy()
        coordinates = coordinates_from_cosines(gram.cosines.numpy())
        return self._weighting(coordinates, sizes / sizes.max()).weighting

    def refine(
        self,
        jacobian: torch.Tensor,
        objectives: torch.Tensor,
        gram: CosineGram,
        weighting: WeighResult,
    ) -> WeighResult | None:
        """Re-solve on the stack's QR coordinates when the Gram says near-dependent."""
        if not near_dependent(gram.cosines.numpy()):
            return None
        basis, coordinates, sizes = coordinates_from_stack(jacobian[objectives.to(jacobian.device)])
        if not np.isfinite(sizes).all():
            return None  # a norm beyond float64 (entries near 1e308): the Gram's answer stands
        solved = self._weighting(coordinates, sizes / sizes.max())
        if solved.direction is None:
            return solved.weighting
        direction = float(sizes.max()) * (basis @ torch.from_numpy(solved.direction))
        return WeighResult(
            solved.weighting.weights,
            solved.weighting.kkt_residual,
            solved.weighting.fallback,
            {**solved.weighting.extras, "refined_on_stack": True},
            direction.to(dtype=jacobian.dtype, device=jacobian.device),
        )

    def _weighting(self, coordinates: np.ndarray, norms: np.ndarray) -> _Solved:
        """CAGrad on unit vectors given by ``coordinates`` (columns) scaled by ``norms``."""
        count = len(norms)
        points = coordinates * norms[None, :]  # g_k / max ||g||, in the span's coordinates
        mean_weights = np.full(count, 1.0 / count)
        mean = points @ mean_weights
        radius = self.c * float(np.linalg.norm(mean))
        divisor = 1.0 + self.c**2 if self.rescale else 1.0
        if float(np.linalg.norm(mean)) <= 64 * _EPS * float(norms.mean()):
            # g0 = 0 up to the round-off of averaging: d = g0 for every c.
            weights = torch.from_numpy(mean_weights / divisor)
            return _Solved(WeighResult(weights, 0.0, "zero_mean_gradient"), None)
        if radius == 0.0:
            return _Solved(WeighResult(torch.from_numpy(mean_weights / divisor), 0.0), mean)
        dual = _solve_dual(points, norms, mean, radius)
        if dual.stationary:
            # 0 is in the hull and F's minimum is 0 at g_w = 0. For c >= 1 the ball holds
            # d = 0, the answer. For c < 1 (0 exactly on a support's affine hull) the
            # maximizers are not unique and d = g0 is kept, uncertified.
            if self.c >= 1.0:
                zeros = torch.zeros(count, dtype=torch.float64)
                return _Solved(WeighResult(zeros, 0.0, "pareto_stationary"), None)
            weights = torch.from_numpy(mean_weights / divisor)
            return _Solved(WeighResult(weights, None, "pareto_stationary"), mean / divisor)
        combined = points @ dual.weights
        size = float(np.linalg.norm(combined))
        weights = (mean_weights + (radius / size) * dual.weights) / divisor
        direction = (mean + (radius / size) * combined) / divisor
        extras = {
            "dual_weights": dual.weights.tolist(),
            "lambda": size / radius,
            "iterations": dual.iterations,
        }
        return _Solved(
            WeighResult(torch.from_numpy(weights), kkt_residual=dual.residual, extras=extras),
            direction,
        )


@dataclass(frozen=True)
class _Solved:
    weighting: WeighResult
    direction: np.ndarray | None  # d in the coordinates (units of max ||g||), when formed


@dataclass(frozen=True)
class _Dual:
    weights: np.ndarray
    residual: float
    iterations: int
    stationary: bool  # g_w = 0 is optimal: 0 is in the convex hull of the gradients


def _solve_dual(points: np.ndarray, norms: np.ndarray, mean: np.ndarray, radius: float) -> _Dual:
    """Wolfe's method on min over the simplex of F(w) = g_w . g0 + radius ||g_w||."""
    count = len(norms)
    weights = np.zeros(count)
    start = int(np.argmin(points.T @ mean + radius * norms))  # the best vertex
    weights[start] = 1.0
    support = [start]
    iteration = 0
    for iteration in range(1, _MAX_ITERATIONS + 1):
        violations = _violations(points, norms, mean, radius, weights, support)
        if violations is None:
            return _Dual(weights, 0.0, iteration, stationary=True)
        violations[support] = -np.inf  # the support is equalized by the minor cycle
        entering = int(np.argmax(violations))
        if violations[entering] <= _TOLERANCE:
            break
        support.append(entering)
        step = _minor_cycle(points, norms, mean, radius, weights, support)
        if step is None:
            return _Dual(weights, 0.0, iteration, stationary=True)
        weights, support = step
        if entering not in support and weights[entering] == 0.0:
            break  # the entering point could not get weight: no progress at this precision
    violations = _violations(points, norms, mean, radius, weights, support)
    if violations is None:
        return _Dual(weights, 0.0, iteration, stationary=True)
    on_support = np.zeros(count, dtype=bool)
    on_support[support] = True
    residual = float(np.max(np.where(on_support, np.abs(violations), violations)))
    return _Dual(weights, max(residual, 0.0), iteration, stationary=False)


def _violations(
    points: np.ndarray,
    norms: np.ndarray,
    mean: np.ndarray,
    radius: float,
    weights: np.ndarray,
    support: list[int],
) -> np.ndarray | None:
    """(mu - g_k . d) / (|mu| + ||g_k|| (||g0|| + s)) for every k; None if g_w = 0."""
    combined = points[:, support] @ weights[support]
    size = float(np.linalg.norm(combined))
    if size == 0.0:
        return None
    direction = mean + (radius / size) * combined
    products = points.T @ direction
    # mu from the smallest support gradient: the others' products carry larger round-off.
    level = float(products[min(support, key=lambda index: norms[index])])
    # ||g0|| + radius bounds ||d|| and sizes its round-off, also when d cancels (c >= 1).
    scale = abs(level) + norms * (float(np.linalg.norm(mean)) + radius)
    return (level - products) / scale


def _minor_cycle(
    points: np.ndarray,
    norms: np.ndarray,
    mean: np.ndarray,
    radius: float,
    weights: np.ndarray,
    support: list[int],
) -> tuple[np.ndarray, list[int]] | None:
    """Move from ``weights`` towards F's minimizer on aff(support), dropping points that
    reach weight zero, until that minimizer is inside the simplex. None if it is g_w = 0."""
    weights = weights.copy()
    support = list(support)
    while True:
        target, is_point = _affine_target(points, norms, mean, radius, support)
        if target is None:
            return None
        if is_point and np.all(target[support] > 0):
            return target, support
        direction = target - weights if is_point else target
        blocking = [index for index in support if direction[index] < 0]
        if not blocking:
            # Only zero weights (the entering point) have target <= 0, or the ray is zero.
            if not is_point:
                return weights, support
            weights = np.maximum(target, 0.0)
            support = [index for index in support if weights[index] > 0]
            return weights / weights.sum(), support
        step = min(weights[index] / -direction[index] for index in blocking)
        if is_point:
            step = min(step, 1.0)
        leaving = min(blocking, key=lambda index: weights[index] / -direction[index])
        weights = np.maximum(weights + step * direction, 0.0)
        weights[leaving] = 0.0
        support = [index for index in support if weights[index] > 0]
        weights /= weights.sum()


def _affine_target(
    points: np.ndarray, norms: np.ndarray, mean: np.ndarray, radius: float, support: list[int]
) -> tuple[np.ndarray | None, bool]:
    """F's minimizer on the affine hull of the support (weights summing to 1, True), or a
    descent ray along which F decreases without bound (weights summing to 0, False).

    With m the min-norm point of aff(g_S) and h the projection of g0 on the span of the
    differences, F(m + y) = m.g0 + y.h + s sqrt(||m||^2 + ||y||^2) over y in that span,
    minimized at y = -lam h with lam = ||m|| / sqrt(s^2 - ||h||^2). Differences are taken
    from the smallest support point and unit-scaled, so small gradients keep their digits.
    Returns (None, True) when the minimizer is g_w = 0 (0 in the support's hull).
    """
    count = len(norms)
    anchor = min(support, key=lambda index: norms[index])
    others = [index for index in support if index != anchor]
    target = np.zeros(count)
    if not others:
        target[anchor] = 1.0
        return target, True
    differences = points[:, others] - points[:, [anchor]]
    scales = np.linalg.norm(differences, axis=0)
    left, singular, right = np.linalg.svd(differences / scales, full_matrices=False)
    rank = int(np.sum(singular > _RANK_TOLERANCE * singular[0]))
    left, singular, right = left[:, :rank], singular[:rank], right[:rank]

    def coefficients(vector: np.ndarray) -> np.ndarray:
        """t with sum_k t_k (g_k - g_anchor) = vector (vector in the span)."""
        return (right.T @ ((left.T @ vector) / singular)) / scales

    anchor_point = points[:, anchor]
    nearest = anchor_point - left @ (left.T @ anchor_point)  # min-norm point of aff(g_S)
    shift = left @ (left.T @ mean)
    room = radius**2 - float(shift @ shift)
    nearest_size = float(np.linalg.norm(nearest))
    if room <= 0.0:
        ray = coefficients(-shift)
        target[others] = ray
        target[anchor] = -ray.sum()
        return target, False
    if nearest_size <= 64 * _EPS * norms[anchor]:
        # 0 is in aff(g_S) and F >= 0 on it: the minimizer is g_w = 0 if inside the simplex.
        solved = coefficients(-anchor_point)
        target[others] = solved
        target[anchor] = 1.0 - solved.sum()
        return (None, True) if np.all(target[support] >= 0) else (target, True)
    shift_size = nearest_size / math.sqrt(room)
    solved = coefficients(nearest - shift_size * shift - anchor_point)
    target[others] = solved
    target[anchor] = 1.0 - solved.sum()
    return target, True
