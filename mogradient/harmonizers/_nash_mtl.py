"""Nash-MTL: the Nash bargaining solution, G alpha = 1 / alpha, solved exactly."""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
import torch

from mogradient._gram import CosineGram
from mogradient.harmonizers._base import Harmonizer, WeighResult, zero_in_hull
from mogradient.harmonizers.promises import NON_CONFLICTING, PERMUTATION_INVARIANT, STATIONARY_ZERO

# Newton's answer is accepted only if it solves G alpha = 1/alpha to this relative accuracy;
# round-off on a well-posed problem is many orders of magnitude below it.
_ACCEPT = 1e-8


class NashMTL(Harmonizer):
    """Bargaining-game weights (Navon et al. 2022, Multi-Task Learning as a Bargaining Game).

    The Nash bargaining direction d = J^T alpha has alpha > 0 with g_k . d = 1 / alpha_k,
    i.e. G alpha = 1 / alpha. That is the stationarity condition of the strictly convex,
    self-concordant phi(a) = a^T G a / 2 - sum_k log a_k, so damped Newton (Nesterov's
    step 1 / (1 + decrement), then full steps) in float64 solves it to round-off, unlike
    the paper's few rounds of a linearized cvxpy problem. We solve it in each gradient's
    own units: with G = N C N (N the norms, C the cosines), beta = N alpha solves
    C beta = 1 / beta, which does not involve the norms at all (Newton's iterates are the
    same under this change of variables); then alpha_k = beta_k / ||g_k||.

    If some non-negative combination of the gradients is zero (a Pareto-stationary point)
    phi is unbounded below and no solution exists: no direction improves every objective,
    so the weights are zero (``fallback="pareto_stationary"``). A ridged solve would
    return huge weights that cancel, which an amortized cache must never keep. "Zero"
    is taken at the gradients' precision ([`zero_in_hull`][mogradient.harmonizers.zero_in_hull]):
    a float32 pair [x, -1.3 x] is opposed within float32's, and the exact solution for
    its rounded entries (weights ~1e7) gives a float32 direction of pure round-off.
    ``kkt_residual`` is the largest relative violation of the promise u_k . d = 1/beta_k
    by d formed in the gradients' precision eps:
    max_k (|(C beta)_k - 1/beta_k| + eps sum_j beta_j) beta_k.

    At the solution ||d||^2 = alpha^T G alpha = K whatever the gradients' scale. As in the
    authors' code (and TorchJD), ``max_norm > 0`` rescales alpha so that ||d|| <= max_norm
    (default 1.0); ``max_norm=0`` returns the bargaining solution itself.
    """

    promises: ClassVar[frozenset[str]] = frozenset(
        {NON_CONFLICTING, PERMUTATION_INVARIANT, STATIONARY_ZERO}
    )
    fallbacks: ClassVar[frozenset[str]] = frozenset({"pareto_stationary"})

    def __init__(
        self,
        max_norm: float = 1.0,
        tolerance: float = 1e-13,
        max_iterations: int = 200,
    ) -> None:
        if not (math.isfinite(max_norm) and max_norm >= 0):
            raise ValueError(f"max_norm must be finite and >= 0 (0 disables), got {max_norm}")
        if not (math.isfinite(tolerance) and tolerance > 0):
            raise ValueError(f"tolerance must be finite and positive, got {tolerance}")
        if int(max_iterations) != max_iterations or max_iterations < 1:
            raise ValueError(f"max_iterations must be a positive integer, got {max_iterations}")
        self.max_norm = float(max_norm)
        self.tolerance = float(tolerance)
        self.max_iterations = int(max_iterations)

    def weigh(self, gram: CosineGram, objectives: torch.Tensor) -> WeighResult:
        beta, iterations = (None, 0) if zero_in_hull(gram) else self._newton(gram.cosines)
        if beta is None:
            zeros = torch.zeros(len(gram), dtype=torch.float64)
            return WeighResult(
                zeros, fallback="pareto_stationary", extras={"newton_iterations": iterations}
            )
        residual = _promise_residual(gram.cosines, beta, gram.eps)
        # ||d|| = ||sum_k beta_k u_k||: no norm enters.
        direction_norm = float(torch.sqrt((beta @ gram.cosines @ beta).clamp_min(0)))
        if self.max_norm > 0 and direction_norm > self.max_norm:
            beta = beta * (self.max_norm / direction_norm)
        alpha = np.ldexp((beta / gram.norms).numpy(), -gram.exponent)
        return WeighResult(
            torch.from_numpy(alpha),
            kkt_residual=residual,
            extras={"newton_iterations": iterations, "bargaining_norm": direction_norm},
        )

    def _newton(self, gram: torch.Tensor) -> tuple[torch.Tensor | None, int]:
        """Minimize a^T G a / 2 - sum log a; None when it has no minimizer.

        For a self-concordant function a Newton decrement below 1 proves that a minimizer
        exists (Nesterov 2004, Thm 4.1.11), so an unbounded phi keeps it >= 1. Below 1/4
        we take full steps (quadratic convergence); when the decrement stops shrinking
        there, round-off has been reached.
        """
        # Exact for diagonal G, and a scale-appropriate start otherwise.
        alpha = 1.0 / torch.sqrt(torch.diagonal(gram))
        previous = math.inf
        for iteration in range(1, self.max_iterations + 1):
            gradient = gram @ alpha - 1.0 / alpha
            hessian = gram + torch.diag(1.0 / alpha**2)
            try:
                step = torch.linalg.solve(hessian, gradient)
            except RuntimeError:  # torch.linalg.LinAlgError: alpha ran off to infinity
                return None, iteration
            decrement = float(torch.sqrt((gradient @ step).clamp_min(0)))
            if decrement <= self.tolerance or (previous < 0.25 and decrement > 0.5 * previous):
                return (alpha if _solves(gram, alpha) else None), iteration
            # The damped step 1 / (1 + decrement) keeps alpha > 0 (self-concordance).
            alpha = alpha - (step if decrement < 0.25 else step / (1.0 + decrement))
            if not torch.isfinite(alpha).all() or (alpha <= 0).any():
                return None, iteration
            previous = decrement
        converged = previous < 1 and _solves(gram, alpha)
        return (alpha if converged else None), self.max_iterations


def _solves(gram: torch.Tensor, alpha: torch.Tensor) -> bool:
    """Whether alpha solves G alpha = 1/alpha to the acceptance accuracy."""
    return _relative_residual(gram, alpha) <= _ACCEPT


def _relative_residual(gram: torch.Tensor, alpha: torch.Tensor) -> float:
    """||G alpha - 1/alpha|| / ||1/alpha||."""
    inverse = 1.0 / alpha
    return float(torch.linalg.norm(gram @ alpha - inverse) / torch.linalg.norm(inverse))


def _promise_residual(gram: torch.Tensor, beta: torch.Tensor, eps: float) -> float:
    """max_k (|(C beta)_k - 1/beta_k| + eps sum_j beta_j) beta_k: how far u_k . d may be
    from its promised 1/beta_k, relative to it, when d = sum_j beta_j u_j is formed from
    unit gradients each known to eps."""
    gap = (gram @ beta - 1.0 / beta).abs() + eps * float(beta.sum())
    return float((gap * beta).max())
