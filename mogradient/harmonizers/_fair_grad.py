"""FairGrad: alpha-fair shares of the update among objectives, solved on the Gram matrix."""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
import torch

from mogradient._gram import CosineGram
from mogradient.errors import SolverError
from mogradient.harmonizers._base import Harmonizer, WeighResult, zero_in_hull
from mogradient.harmonizers.promises import NON_CONFLICTING, PERMUTATION_INVARIANT, STATIONARY_ZERO

# Residual of the weight system, relative to its terms' sizes, at which Newton stops.
_TOLERANCE = 1e-13
_MAX_ITERATIONS = 200


class FairGrad(Harmonizer):
    """Alpha-fair update direction (Ban & Ji, Fair Resource Allocation in Multi-Task Learning,
    ICML 2024; arXiv 2402.15638).

    The update d = sum_k w_k g_k maximizes sum_k (g_k . d)^(1 - alpha) / (1 - alpha)
    (log for alpha = 1) over a ball; its optimality condition is the weight system
    G w = w^(-1/alpha), w > 0, the one the authors' code solves (OptMN-Lab/fairgrad,
    methods/weight_methods.py, ``FairGrad.fairgrad``: G w - (1/w)^(1/alpha) = 0 by bounded
    least squares). alpha = 0 is linear scalarization, where that system is undefined; the
    weights are then uniform, w = 1/K (as TorchJD takes them), alpha = 1 proportional
    fairness (Nash-MTL's system), alpha -> infinity max-min fairness.
    Every g_k . d = w_k^(-1/alpha) is positive: the update conflicts with no objective.

    The system is the stationarity condition of the strictly convex
    1/2 w^T G w - sum_k h(w_k), h' = w^(-1/alpha); we minimize it by damped Newton steps
    in b_k = ||g_k|| w_k, where it reads (C b)_k = ||g_k||^((1 - alpha)/alpha) b_k^(-1/alpha)
    (C the cosine matrix), exact at any spread of norms. A minimizer exists unless zero
    is in the convex hull of the gradients (a Pareto-stationary point: no direction
    improves every objective); then the weights are zero with
    ``fallback="pareto_stationary"``. Zero is in the hull when it is within the
    gradients' precision ([`zero_in_hull`][mogradient.harmonizers.zero_in_hull]): a float32
    stack is known to ~1e-7, and the float64 solution for its rounded entries cancels
    into a float32 direction that conflicts with half the gradients. ``kkt_residual`` is
    the largest relative violation of the promise (C b)_k = demand_k by d = sum_k b_k u_k
    formed in the gradients' precision eps: max_k (|(C b)_k - demand_k| + eps sum_j b_j)
    / demand_k. Solved on the Gram only: for near-dependent gradients (smallest cosine
    eigenvalue lambda near eps) the weights carry relative errors up to ~eps / lambda;
    there is no refinement on the stack as in [`ConFIG`][mogradient.harmonizers.ConFIG].
    """

    promises: ClassVar[frozenset[str]] = frozenset(
        {NON_CONFLICTING, PERMUTATION_INVARIANT, STATIONARY_ZERO}
    )
    fallbacks: ClassVar[frozenset[str]] = frozenset({"pareto_stationary"})

    def __init__(self, alpha: float = 1.0) -> None:
        alpha = float(alpha)
        if not (alpha >= 0 and math.isfinite(alpha)):
            raise ValueError(f"alpha must be a finite non-negative number, got {alpha}")
        self.alpha = alpha

    def weigh(self, gram: CosineGram, objectives: torch.Tensor) -> WeighResult:
        count = len(objectives)
        if self.alpha == 0:
            return WeighResult(torch.full((count,), 1.0 / count, dtype=torch.float64))
        if zero_in_hull(gram):
            return WeighResult(
                torch.zeros(count, dtype=torch.float64), fallback="pareto_stationary"
            )
        cosines = gram.cosines.numpy()
        # log ||g_k||, and the system's factors c_k = ||g_k||^((1 - alpha)/alpha) divided by
        # the largest, lam: with c = lam c', the solution is b = lam^(alpha/(alpha+1)) b'.
        log_norms = np.log(gram.norms.numpy()) + gram.exponent * math.log(2.0)
        log_factors = (1.0 - self.alpha) / self.alpha * log_norms
        log_scale = float(log_factors.max())
        factors = np.exp(log_factors - log_scale)
        coefficients = _solve(cosines, factors, self.alpha)
        residual = _promise_residual(cosines, factors, coefficients, self.alpha, gram.eps)
        log_weights = self.alpha / (self.alpha + 1.0) * log_scale + np.log(coefficients) - log_norms
        return WeighResult(torch.from_numpy(np.exp(log_weights)), kkt_residual=residual)


def _promise_residual(
    cosines: np.ndarray, factors: np.ndarray, b: np.ndarray, alpha: float, eps: float
) -> float:
    """max_k (|(C b)_k - demand_k| + eps sum_j b_j) / demand_k, demand = factors b^(-1/alpha):
    how far u_k . d may be from its promised value, relative to it, when d = sum_j b_j u_j
    is formed from unit gradients each known to eps."""
    demand = factors * b ** (-1.0 / alpha)
    gap = np.abs(cosines @ b - demand) + eps * float(b.sum())
    return float(np.max(gap / demand))


def _solve(cosines: np.ndarray, factors: np.ndarray, alpha: float) -> np.ndarray:
    """b > 0 with C b = factors * b^(-1/alpha), by damped Newton on the convex potential
    1/2 b^T C b - sum_k factors_k h(b_k)."""
    power = -1.0 / alpha
    absolute = np.abs(cosines)

    def potential(b: np.ndarray) -> tuple[float, float]:
        """The potential and the size of its rounding error."""
        gains = np.log(b) if alpha == 1.0 else b ** (1.0 + power) / (1.0 + power)
        quadratic, linear = 0.5 * float(b @ cosines @ b), float(factors @ gains)
        size = 0.5 * float(b @ absolute @ b) + float(factors @ np.abs(gains))
        return quadratic - linear, 16 * np.finfo(float).eps * size

    def residual(b: np.ndarray) -> tuple[np.ndarray, float]:
        demand = factors * b**power
        gap = cosines @ b - demand
        return gap, float(np.max(np.abs(gap) / (demand + absolute @ b)))

    # The solution when the gradients are orthogonal (C = I).
    b = factors ** (alpha / (alpha + 1.0))
    gap, relative = residual(b)
    for _ in range(_MAX_ITERATIONS):
        if relative <= _TOLERANCE:
            return b
        hessian = cosines + np.diag(-power * factors * b ** (power - 1.0))
        scale = 1.0 / np.sqrt(np.diag(hessian))
        step = -scale * np.linalg.solve(hessian * np.outer(scale, scale), scale * gap)
        # Stay positive: at most 99% of the way to the nearest boundary.
        shrinking = step < 0
        length = min(1.0, 0.99 * float(np.min(b[shrinking] / -step[shrinking], initial=np.inf)))
        start, rounding = potential(b)
        slope = float(gap @ step)
        while (
            potential(b + length * step)[0] > start + 1e-4 * length * slope + rounding
            and length > 1e-12
        ):
            length *= 0.5
        b = b + length * step
        gap, relative = residual(b)
    if relative > 1e-8:
        raise SolverError(
            f"FairGrad's weight system did not converge (relative residual {relative:.2e})"
        )
    return b
