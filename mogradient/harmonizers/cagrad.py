"""CAGrad: the best worst-case improvement within a ball around the mean gradient."""

from __future__ import annotations

import math

import numpy as np
import torch

from mogradient.harmonizers.base import Harmonizer, Weighting
from mogradient.qp import solve_simplex_qp

_MAX_ITERATIONS = 100
_ACCEPT_RESIDUAL = 1e-10


class CAGrad(Harmonizer):
    """Conflict-averse gradient descent (Liu et al. 2021, Conflict-Averse Gradient Descent).

    CAGrad maximizes min_k g_k . d over the ball ||d - g0|| <= c ||g0|| (g0 the mean
    gradient). Its dual is min over the simplex of F(w) = g_w . g0 + s ||g_w|| with
    g_w = J^T w and s = c ||g0||, and then d = g0 + (s / ||g_w||) g_w, i.e. raw weights
    1/K + (s / ||g_w||) w (paper's Algorithm 1, and TorchJD).

    We solve the dual exactly instead of with a generic solver: writing
    s ||x|| = min_t s (||x||^2 / (2t) + t / 2) and t = s * lam turns it into a 1-D convex
    problem whose inner problem is MGDA's min-norm QP on the shifted points g_k + lam g0
    (exact, :func:`mogradient.qp.solve_simplex_qp`), with optimality condition
    ||g_w(lam)|| = s * lam. On a fixed support g_w(lam) is affine in lam, so each step
    solves a quadratic; a bracket keeps it safe. ``kkt_residual`` is F's KKT residual in
    units of max ||g_k||^2.

    ``rescale=True`` divides the direction by 1 + c^2, the authors' code default (not in
    the paper). If the optimal g_w is zero (a Pareto-stationary point with c >= 1) the
    direction is zero (``fallback="pareto_stationary"``); if g0 is zero it is g0.
    """

    def __init__(self, c: float = 0.5, rescale: bool = False) -> None:
        if not (math.isfinite(c) and c >= 0):
            raise ValueError(f"c must be a finite non-negative number, got {c}")
        self.c = float(c)
        self.rescale = bool(rescale)

    def weigh(self, gram: torch.Tensor, objectives: torch.Tensor) -> Weighting:
        count = len(objectives)
        normalized = (gram / torch.diagonal(gram).max()).numpy()
        mean_weights = np.full(count, 1.0 / count)
        linear = normalized @ mean_weights  # g_k . g0
        mean_sq_norm = float(mean_weights @ linear)  # ||g0||^2
        radius = self.c * math.sqrt(max(mean_sq_norm, 0.0))
        divisor = 1.0 + self.c**2 if self.rescale else 1.0
        if radius <= 1e-15:
            # c = 0 (or so small that the ball is a point), or g0 = 0 up to round-off: d = g0.
            fallback = "zero_mean_gradient" if mean_sq_norm <= 1e-24 else None
            return Weighting(torch.from_numpy(mean_weights / divisor), 0.0, fallback)
        solution = _solve_dual(normalized, linear, mean_sq_norm, radius)
        if solution is None:
            return Weighting(
                torch.zeros(count, dtype=torch.float64), 0.0, fallback="pareto_stationary"
            )
        weights_on_simplex, shift, iterations = solution
        norm = math.sqrt(max(float(weights_on_simplex @ normalized @ weights_on_simplex), 0.0))
        residual = _dual_kkt_residual(normalized, linear, radius, weights_on_simplex)
        weights = (mean_weights + (radius / norm) * weights_on_simplex) / divisor
        return Weighting(
            torch.from_numpy(weights),
            kkt_residual=residual,
            extras={
                "dual_weights": weights_on_simplex.tolist(),
                "lambda": shift,
                "iterations": iterations,
            },
        )


def _shifted_gram(
    gram: np.ndarray, linear: np.ndarray, mean_sq_norm: float, shift: float
) -> np.ndarray:
    """Gram of g_k + shift * g0."""
    ones = np.ones(len(gram))
    return (
        gram
        + shift * (np.outer(linear, ones) + np.outer(ones, linear))
        + shift**2 * mean_sq_norm * np.outer(ones, ones)
    )


def _inner(
    gram: np.ndarray, linear: np.ndarray, mean_sq_norm: float, shift: float
) -> tuple[np.ndarray, float]:
    """Simplex weights of the min-norm point of {g_k + shift g0}, and ||g_w||."""
    weights = solve_simplex_qp(_shifted_gram(gram, linear, mean_sq_norm, shift)).weights
    return weights, math.sqrt(max(float(weights @ gram @ weights), 0.0))


def _affine_piece(
    gram: np.ndarray, linear: np.ndarray, support: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """w(lam) = base + lam * slope minimizes ||g_w + lam g0||^2 on the support's affine hull."""
    size = int(support.sum())
    system = np.zeros((size + 1, size + 1))
    system[:size, :size] = gram[np.ix_(support, support)]
    system[:size, size] = 1.0
    system[size, :size] = 1.0
    rhs = np.zeros((size + 1, 2))
    rhs[size, 0] = 1.0
    rhs[:size, 1] = -linear[support]
    solved = np.linalg.lstsq(system, rhs, rcond=1e-13)[0][:size]
    base = np.zeros(len(gram))
    slope = np.zeros(len(gram))
    base[support], slope[support] = solved[:, 0], solved[:, 1]
    return base, slope


def _piece_root(
    gram: np.ndarray, base: np.ndarray, slope: np.ndarray, radius: float, lo: float, hi: float
) -> float | None:
    """lam in (lo, hi) with ||g_{base + lam slope}|| = radius * lam, or None."""
    a = float(slope @ gram @ slope) - radius**2
    b = float(base @ gram @ slope)
    c = float(base @ gram @ base)
    # ||g_base|| = 0 (0 in the support's affine hull) up to round-off: then
    # ||g_w(lam)|| / lam is constant on the piece and round-off must not create a root.
    noise = 1e-13 * (1.0 + float(np.abs(base).sum()) + float(np.abs(slope).sum())) ** 2
    c = 0.0 if c <= noise else c
    b = 0.0 if abs(b) <= noise else b
    if abs(a) <= 1e-14 * (abs(b) + abs(c) + radius**2):
        roots = [-c / (2 * b)] if b != 0 else []
    else:
        disc = b * b - a * c
        if disc < 0:
            return None
        root = math.sqrt(disc)
        # Numerically stable pair of roots of a lam^2 + 2 b lam + c.
        q = -(b + math.copysign(root, b))
        roots = [q / a] + ([c / q] if q != 0 else [])
    inside = [lam for lam in roots if lo < lam < hi]
    return min(inside) if inside else None


def _solve_dual(
    gram: np.ndarray, linear: np.ndarray, mean_sq_norm: float, radius: float
) -> tuple[np.ndarray, float, int] | None:
    """Weights of min_{w in simplex} w.linear + radius ||g_w||; None if ||g_w*|| = 0."""
    # psi(lam) = ||g_w(lam)|| / lam - radius decreases; psi(0+) > 0 unless the min-norm
    # point is zero, and psi(lam) < 0 for lam > 1 / radius since ||g_w|| <= 1 (normalized).
    lo, hi = 0.0, 2.0 / radius
    weights, norm = _inner(gram, linear, mean_sq_norm, 0.0)
    if norm <= 1e-12 and radius >= math.sqrt(mean_sq_norm):
        # 0 is in the hull and c >= 1: F >= (c - 1) ||g0|| ||g_w|| >= 0 = F(w_mgda).
        return None
    shift = 0.0
    for iteration in range(1, _MAX_ITERATIONS + 1):
        support = weights > 0
        base, slope = _affine_piece(gram, linear, support)
        root = _piece_root(gram, base, slope, radius, lo, hi)
        bisection = 0.5 * (lo + hi) if lo == 0 else math.sqrt(lo * hi)
        shift = root if root is not None else bisection
        weights, norm = _inner(gram, linear, mean_sq_norm, shift)
        if norm > radius * shift:
            lo = shift
        else:
            hi = shift
        piece = base + shift * slope
        if root is not None and np.array_equal(weights > 0, support) and np.all(piece >= 0):
            # Same support as the piece the root came from: the root is exact, unless
            # round-off made it up (checked by the KKT conditions of the dual).
            piece = np.maximum(piece, 0.0) / np.maximum(piece, 0.0).sum()
            if _dual_kkt_residual(gram, linear, radius, piece) <= _ACCEPT_RESIDUAL:
                return piece, shift, iteration
        if hi - lo <= 1e-15 * hi:
            break
    if norm <= 1e-12:
        return None
    return weights, shift, iteration


def _dual_kkt_residual(
    gram: np.ndarray, linear: np.ndarray, radius: float, weights: np.ndarray
) -> float:
    """KKT residual of min over the simplex of w.linear + radius ||g_w|| (G max diag 1)."""
    norm = math.sqrt(max(float(weights @ gram @ weights), 0.0))
    if norm == 0.0:
        return math.inf  # F is not differentiable there; such points are handled apart
    gradient = linear + (radius / norm) * (gram @ weights)
    value = float(weights @ gradient)
    support = weights > 0
    stationarity = float(np.max(np.abs(gradient[support] - value)))
    descent = float(np.max(np.maximum(value - gradient, 0.0)))
    feasibility = abs(float(weights.sum()) - 1.0) + float(np.max(np.maximum(-weights, 0.0)))
    return max(stationarity, descent) + feasibility
