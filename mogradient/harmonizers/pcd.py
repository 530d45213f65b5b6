"""PCD: follow the primary objective's gradient, guaranteeing every other one some progress."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mogradient._gram import CosineGram
from mogradient._qp_cone import near_dependent
from mogradient._span import coordinates_from_cosines, coordinates_from_stack
from mogradient.harmonizers.base import Harmonizer, WeighResult

_EPS = float(np.finfo(np.float64).eps)
# A constraint counts as violated beyond this many units of round-off in u_j . y.
_VIOLATION_TOLERANCE = 64 * _EPS
# Active columns (unit vectors) whose smallest singular value is below this of the largest
# are dependent: Gram square roots resolve ~1e-8 (as in _qp_cone); a stack's QR ~eps.
_GRAM_RANK_TOLERANCE = 1e-10
_STACK_RANK_TOLERANCE = 64 * _EPS
# Entries of a dependence z (a_e = A z) below this of max|z| are round-off zeros.
_DEPENDENCE_ZERO = 1e-12


@dataclass(frozen=True)
class _Solution:
    """The PCD problem solved in span coordinates: d~ = y and the multipliers lambda_j >= 0
    of the unit constraints u_j . y >= b_j, so that y = a_1 u_1 + sum_j lambda_j u_j."""

    direction: np.ndarray
    multipliers: np.ndarray
    kkt_residual: float


class PCD(Harmonizer):
    """Priority-Constrained Descent (Varam et al., TMLR 2026, "Not All Objectives Are Born
    Equal: Priority-Constrained Descent for Hierarchical Multi-Objective Optimization",
    https://openreview.net/forum?id=HT01yGHLEt).

    Objectives are not equal: row 0 of the caller's order is the primary one, the others
    are secondary. PCD follows the primary gradient as closely as possible while giving
    every secondary objective j at least a fraction ``tau`` of the first-order progress
    of a step along its own normalized gradient:

        d~ = argmin_d 1/2 ||d - g~_1||^2  s.t.  g~_j . d >= tau_j ||g~_j||^2  (j >= 2),

    with g~_i = s_i g_i, s_i = 1 / sqrt(v^_i + eps) and v^_i the bias-corrected moving
    average (decay ``beta``) of ||g_i||^2 over the calls. The direction is d~ rescaled to
    ||g_1||. The normalization makes ``tau`` scale-free (up to ``eps``, an absolute guard
    kept for parity with TorchJD 0.18's ``PCD``, whose defaults these are).

    How it is solved: the dual is a box-constrained QP on the Gram of the normalized
    gradients, min_{lambda >= 0} 1/2 ||a_1 u_1 + sum_j lambda_j u_j||^2 - sum_j b_j lambda_j
    (u_i unit vectors, a_i = s_i ||g_i||, b_j = tau_j a_j), whose stationary point is
    d~ = a_1 u_1 + sum_j lambda_j u_j. An active set method solves it in span coordinates
    of the cosines (never the squared norms, so any spread of norms is exact), reading d~
    as an orthogonal residual, and handles an entering constraint that depends on the
    active ones by swapping. With ``refine=True`` and a stack given, near-dependent
    gradients are re-solved on a QR of the stack, and the direction is formed there
    (the multipliers then cancel: an opposed pair g, -g + 1e-7 noise needs lambda ~1e12).

    Cases: if the constraints cannot all hold (a non-negative combination of secondary
    gradients is zero, e.g. two opposed ones, with tau > 0) they are dropped and the
    direction is g_1 (``fallback="infeasible"``, as TorchJD). If d~ is zero to round-off
    (possible with tau = 0) the direction is zero (``fallback="zero_direction"``). If
    objective 0 is unusable (zero or non-finite, so the base class drops it) there is no
    primary to follow and the direction is zero (``fallback="primary_dropped"``), as TorchJD
    gives for g_1 = 0; the secondaries' averages are still updated.

    State, per objective in the caller's numbering: the moving average (kept as its root,
    a mantissa and a power of two, updated with hypot so no squared norm over- or
    underflows) and its own count of updates for the bias correction. A dropped objective
    keeps its state untouched. TorchJD instead resets everything when the number of rows
    changes and folds a zero g_1 into g_1's average; with every objective usable at every
    call, both are the same. ``tau`` is one float or one value per secondary objective
    (``tau[k - 1]`` for objective k).
    """

    def __init__(
        self,
        tau: float | Sequence[float] | torch.Tensor = 0.02,
        beta: float = 0.999,
        eps: float = 1e-8,
        refine: bool = True,
    ) -> None:
        self.tau = _validated_tau(tau)
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta must be in [0, 1), got {beta}")
        if not (math.isfinite(eps) and eps >= 0.0):
            raise ValueError(f"eps must be finite and non-negative, got {eps}")
        self.beta = float(beta)
        self.eps = float(eps)
        self.refine_on_stack = bool(refine)
        self.reset()

    def reset(self) -> None:
        """Forget the moving averages (start of a new run)."""
        self._roots: dict[int, tuple[float, int]] = {}
        self._counts: dict[int, int] = {}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "roots": dict(self._roots), "counts": dict(self._counts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._roots = dict(state["roots"])
        self._counts = dict(state["counts"])

    def weigh(self, gram: CosineGram, objectives: torch.Tensor) -> WeighResult:
        names = [int(index) for index in objectives]
        # Checked before the state changes: a call that raises leaves the averages as they were.
        taus = self._taus(names) if names[0] == 0 else None
        sizes = self._normalized_norms(names, gram)
        if taus is None:
            zeros = torch.zeros(len(names), dtype=torch.float64)
            return WeighResult(zeros, fallback="primary_dropped")
        coordinates = coordinates_from_cosines(gram.cosines.numpy())
        solution = _solve(coordinates, sizes, taus, _GRAM_RANK_TOLERANCE)
        return _weighting(solution, sizes, gram.norms.numpy())

    def refine(
        self,
        jacobian: torch.Tensor,
        objectives: torch.Tensor,
        gram: CosineGram,
        weighting: WeighResult,
    ) -> WeighResult | None:
        """Near-dependent gradients re-solved on a QR of the stack, direction formed there."""
        if not (
            self.refine_on_stack
            and weighting.fallback != "primary_dropped"
            and near_dependent(gram.cosines.numpy())
        ):
            return None
        names = [int(index) for index in objectives]
        sizes = np.asarray(weighting.extras["normalized_norms"])
        basis, coordinates, norms = coordinates_from_stack(jacobian[objectives.to(jacobian.device)])
        solution = _solve(coordinates, sizes, self._taus(names), _STACK_RANK_TOLERANCE)
        refined = _weighting(solution, sizes, norms / norms[0])
        if solution is None or refined.fallback == "zero_direction":
            return refined
        length = float(np.linalg.norm(solution.direction))
        spanned = torch.from_numpy(solution.direction * (norms[0] / length))
        direction = basis @ spanned.to(basis.device)
        return WeighResult(
            refined.weights,
            kkt_residual=refined.kkt_residual,
            extras={**refined.extras, "refined_on_stack": True},
            direction=direction.to(dtype=jacobian.dtype),
        )

    def _normalized_norms(self, names: list[int], gram: CosineGram) -> np.ndarray:
        """Update each objective's moving average with ||g_i||^2; return a_i = s_i ||g_i||.

        Magnitudes are (mantissa, power of two) pairs: ||g_i|| = n_i 2^exponent need not
        be a float64 (a float64 row of entries near 1e308), nor its square.
        """
        sizes = np.zeros(len(names))
        guard = math.frexp(math.sqrt(self.eps))
        for position, name in enumerate(names):
            norm = math.frexp(float(gram.norms[position]))
            norm = (norm[0], norm[1] + gram.exponent)
            root = self._roots.get(name, (0.0, norm[1]))
            root = _hypot(
                (math.sqrt(self.beta) * root[0], root[1]),
                (math.sqrt(1.0 - self.beta) * norm[0], norm[1]),
            )
            count = self._counts.get(name, 0) + 1
            self._roots[name], self._counts[name] = root, count
            debiased = (root[0] / math.sqrt(1.0 - self.beta**count), root[1])
            denominator = _hypot(debiased, guard)
            sizes[position] = math.ldexp(norm[0] / denominator[0], norm[1] - denominator[1])
        return sizes

    def _taus(self, names: list[int]) -> np.ndarray:
        """tau_j of the usable secondary objectives (names[1:], primary first)."""
        if isinstance(self.tau, float):
            return np.full(len(names) - 1, self.tau)
        if names[-1] > len(self.tau):
            raise ValueError(
                f"got objective index {names[-1]} but tau has {len(self.tau)} values; give "
                "one per secondary objective (objectives 1..K-1)"
            )
        return self.tau.numpy()[[name - 1 for name in names[1:]]]


def _validated_tau(tau: float | Sequence[float] | torch.Tensor) -> float | torch.Tensor:
    """One fraction in [0, 1], or a 1-D float64 vector of them."""
    if isinstance(tau, (int, float)):
        if not 0.0 <= tau <= 1.0:
            raise ValueError(f"tau must be in [0, 1], got {tau}")
        return float(tau)
    values = torch.as_tensor(tau, dtype=torch.float64).detach().cpu()
    if values.ndim != 1 or not bool(((values >= 0) & (values <= 1)).all()):
        raise ValueError(f"tau must be a float or a vector of values in [0, 1], got {tau!r}")
    return values


def _hypot(first: tuple[float, int], second: tuple[float, int]) -> tuple[float, int]:
    """sqrt(x^2 + y^2) for x = m 2^e given as (m, e) pairs, as a frexp pair."""
    top = max(exponent for mantissa, exponent in (first, second) if mantissa != 0.0)
    value = math.hypot(math.ldexp(first[0], first[1] - top), math.ldexp(second[0], second[1] - top))
    mantissa, exponent = math.frexp(value)
    return mantissa, exponent + top


def _weighting(solution: _Solution | None, sizes: np.ndarray, norms: np.ndarray) -> WeighResult:
    """Raw-gradient weights of d~ rescaled to ||g_1||: w_1 = a_1 / ||d~||,
    w_j = lambda_j ||g_1|| / (||g_j|| ||d~||) (``norms`` in any common unit)."""
    count = len(sizes)
    if solution is None:
        weights = torch.zeros(count, dtype=torch.float64)
        weights[0] = 1.0
        return WeighResult(weights, fallback="infeasible", extras={"normalized_norms": sizes})
    length = float(np.linalg.norm(solution.direction))
    # Round-off in y: a few eps of the vectors it is summed from.
    noise = _VIOLATION_TOLERANCE * count * (sizes[0] + float(np.linalg.norm(sizes[1:])))
    extras = {
        "normalized_norms": sizes,
        "multipliers": solution.multipliers / np.where(sizes[1:] > 0, sizes[1:], 1.0),
        "unscaled_norm": length,
    }
    if length <= noise:
        weights = torch.zeros(count, dtype=torch.float64)
        return WeighResult(weights, solution.kkt_residual, "zero_direction", extras)
    weights = np.empty(count)
    weights[0] = sizes[0] / length
    weights[1:] = solution.multipliers * (norms[0] / norms[1:]) / length
    return WeighResult(torch.from_numpy(weights), solution.kkt_residual, extras=extras)


def _solve(
    coordinates: np.ndarray, sizes: np.ndarray, taus: np.ndarray, rank_tolerance: float
) -> _Solution | None:
    """min 1/2 ||y - a_1 u_1||^2 s.t. u_j . y >= b_j = tau_j a_j, or None when infeasible.

    ``coordinates`` (r x K) hold the unit vectors u_i as columns (u_1 first). Active set on
    the dual min_{lambda >= 0} 1/2 ||a_1 u_1 + U lambda||^2 - b . lambda (Lawson and Hanson's
    scheme with a linear term): on an active set P of independent columns
    U_P = L S V^T the stationary point is lambda_P = V (S^-2 V^T b_P - S^-1 L^T p) and
    y = (I - L L^T) p + L S^-1 V^T b_P, formed without cancellation however large lambda.
    A violated constraint that depends on the active ones (u_e = U_P z) makes the dual
    fall linearly along (-z, 1): step until a multiplier with z_i > 0 reaches zero and swap
    it out; with no z_i > 0, (1, -z) >= 0 combines the u's to zero while b_e - z . b_P > 0,
    Farkas' certificate that no y satisfies the constraints.
    """
    target = sizes[0] * coordinates[:, 0]
    columns = coordinates[:, 1:]
    bounds = taus * sizes[1:]
    count = columns.shape[1]
    multipliers = np.zeros(count)
    active = np.zeros(count, dtype=bool)
    usable = sizes[1:] > 0  # an underflowed a_j makes its constraint 0 >= 0
    direction = target.copy()
    iterations = 0
    limit = 10 * count + 20
    while iterations < limit:
        slack = columns.T @ direction - bounds
        noise = _VIOLATION_TOLERANCE * (np.linalg.norm(direction) + bounds)
        candidates = usable & ~active & (slack < -noise)
        if not candidates.any():
            break
        entering = int(np.argmin(np.where(candidates, slack, np.inf)))
        active[entering] = True
        while iterations < limit:
            iterations += 1
            left, singular, right = np.linalg.svd(columns[:, active], full_matrices=False)
            if singular[-1] <= rank_tolerance * singular[0]:
                others = active.copy()
                others[entering] = False
                dependence = np.linalg.lstsq(columns[:, others], columns[:, entering], rcond=None)
                weights = np.zeros(count)
                weights[others] = dependence[0]
                blocking = weights > _DEPENDENCE_ZERO * float(np.max(np.abs(weights)))
                if not blocking.any():
                    return None
                ratios = np.where(blocking, multipliers / np.where(blocking, weights, 1.0), np.inf)
                leaving = int(np.argmin(ratios))
                multipliers = multipliers - ratios[leaving] * weights
                multipliers[entering] += ratios[leaving]
                multipliers[leaving] = 0.0
                active[leaving] = False
                continue
            rotated = right @ bounds[active]
            along = left.T @ target
            trial = np.zeros(count)
            trial[active] = right.T @ (rotated / singular**2 - along / singular)
            if np.all(trial[active] > 0.0):
                multipliers = trial
                direction = target - left @ along + left @ (rotated / singular)
                break
            shrinking = active & (trial <= 0.0)
            step = np.min(
                multipliers[shrinking] / (multipliers[shrinking] - trial[shrinking]),
            )
            multipliers = multipliers + step * (trial - multipliers)
            active &= multipliers > 0.0
            multipliers[~active] = 0.0
            if not active.any():
                direction = target.copy()
                break
    return _Solution(direction, multipliers, _kkt_residual(columns, bounds, multipliers, direction))


def _kkt_residual(
    columns: np.ndarray, bounds: np.ndarray, multipliers: np.ndarray, direction: np.ndarray
) -> float:
    """Largest constraint violation and complementarity |lambda_j (u_j . y - b_j)|, relative
    to ||y|| + max b (stationarity and lambda >= 0 hold by construction)."""
    if columns.shape[1] == 0:
        return 0.0
    scale = float(np.linalg.norm(direction)) + float(np.max(bounds))
    if scale == 0.0:
        return 0.0
    slack = columns.T @ direction - bounds
    violation = max(0.0, float(np.max(-slack)))
    complementarity = float(np.max(np.abs(multipliers * slack)))
    return max(violation / scale, complementarity / (scale * max(1.0, float(multipliers.sum()))))
