"""PCD: follow the primary objective's gradient, guaranteeing every other one some progress."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from mogradient._gram import CosineGram
from mogradient._qp_cone import _nonnegative_least_squares, near_dependent
from mogradient._span import coordinates_from_cosines, coordinates_from_stack
from mogradient.harmonizers._base import Harmonizer, WeighResult, validated_flag

_FLOAT64_EPS = float(np.finfo(np.float64).eps)


@dataclass(frozen=True)
class _Precision:
    """What the span coordinates of the unit gradients resolve.

    ``eps``: each u_j is known to the gradients' precision (``gram.eps``), so an inner
    product u_j . y to eps times the sizes y is summed from. ``resolution``: lengths
    (singular values of unit columns, norms of their combinations) relative to the
    sizes involved. Coordinates from cosines known to ``gram.cosine_eps`` resolve them
    only to sqrt(4 K cosine_eps): a component of size s off another column's span
    changes the cosines by s^2, and cosines off by eps move eigenvalues by up to ~K eps.
    Coordinates from the stack's QR resolve them to K eps: rounding each row to its
    dtype moves its unit vector by <= eps, and so the singular values of the K unit rows
    by <= sqrt(K) eps; never below 64 float64 eps, the float64 QR's own round-off.
    """

    eps: float
    resolution: float

    @classmethod
    def of_gram(cls, gram: CosineGram) -> _Precision:
        return cls(gram.eps, math.sqrt(4 * len(gram) * gram.cosine_eps))

    @classmethod
    def of_stack(cls, gram: CosineGram) -> _Precision:
        return cls(gram.eps, max(len(gram) * gram.eps, 64 * _FLOAT64_EPS))


@dataclass(frozen=True)
class _Solution:
    """The PCD problem solved in span coordinates: d~ = y and the multipliers lambda_j >= 0
    of the unit constraints u_j . y >= b_j, so that y = a_1 u_1 + sum_j lambda_j u_j, with
    ``noise`` the length below which y is round-off."""

    direction: np.ndarray
    multipliers: np.ndarray
    kkt_residual: float
    noise: float


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
    d~ = a_1 u_1 + sum_j lambda_j u_j. We solve the primal as a least-distance problem
    by one NNLS (Lawson and Hanson 1974, ch. 23) in span coordinates of the cosines
    (never the squared norms, so any spread of norms is exact): it terminates for any
    number of constraints (an active set on the dual can cycle when there are more than
    dimensions), reads d~ - a_1 u_1 off an orthogonal residual, and either solves the
    problem or finds Farkas' certificate that it is infeasible. With ``refine=True`` and
    a stack given, near-dependent gradients are re-solved on a QR of the stack, and the
    direction is formed there (the multipliers then cancel: an opposed pair
    g, -g + 1e-7 noise needs lambda ~1e12).

    Cases: if the constraints cannot all hold (a non-negative combination of secondary
    gradients is zero, e.g. two opposed ones, with tau > 0) they are dropped and the
    direction is g_1 (``fallback="infeasible"``, as TorchJD). If d~ is zero to round-off
    (possible with tau = 0) the direction is zero (``fallback="zero_direction"``). If
    objective 0 is unusable (zero or non-finite, so the base class drops it) there is no
    primary to follow and the direction is zero (``fallback="primary_dropped"``), as TorchJD
    gives for g_1 = 0; the secondaries' averages are still updated.

    "Infeasible" and "zero" are decided at the gradients' precision (``gram.eps``: the
    stack's dtype, float32's at best for a Gram passed in; see ``_Precision`` here): a
    certificate sum_j lambda_j u_j = 0 need only hold up to moving each u_j by the
    coordinates' resolution, and d~ is zero below that resolution times the sizes
    a_1 + sum_j lambda_j it is summed from. Why: float32 rows collinear up to their
    rounding are collinear, and the exact solution for their rounded entries is ~1e8
    times the constraints' size in a direction the rounding alone picked (orthogonal to
    every gradient). ``kkt_residual`` is the largest constraint violation (counting the
    eps-sized uncertainty of u_j . d~) or complementarity gap, relative to ||d~|| + max b.

    State, per objective in the caller's numbering: the moving average (kept as its root,
    a mantissa and a power of two, updated with hypot so no squared norm over- or
    underflows) and its own count of updates for the bias correction. A dropped objective
    keeps its state untouched. TorchJD instead resets everything when the number of rows
    changes and folds a zero g_1 into g_1's average; with every objective usable at every
    call, both are the same. ``tau`` is one float or one value per secondary objective
    (``tau[k - 1]`` for objective k).
    """

    fallbacks: ClassVar[frozenset[str]] = frozenset(
        {"infeasible", "zero_direction", "primary_dropped"}
    )

    keeps_objective_state: ClassVar[bool] = True

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
        self.refine_on_stack = validated_flag(refine, "refine")
        self.reset()

    def reset(self) -> None:
        """Forget the moving averages (start of a new run)."""
        super().reset()
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
        solution = _solve(coordinates, sizes, taus, _Precision.of_gram(gram))
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
        if not np.isfinite(norms).all():
            return None  # a norm beyond float64 (entries near 1e308): the Gram's answer stands
        solution = _solve(coordinates, sizes, self._taus(names), _Precision.of_stack(gram))
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
    if first[0] == 0.0 and second[0] == 0.0:
        return 0.0, 0  # a norm that underflowed the Gram's scale (beyond 2^-1074 of the largest)
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
    extras = {
        "normalized_norms": sizes,
        "multipliers": solution.multipliers / np.where(sizes[1:] > 0, sizes[1:], 1.0),
        "unscaled_norm": length,
    }
    if length <= solution.noise:
        weights = torch.zeros(count, dtype=torch.float64)
        return WeighResult(weights, solution.kkt_residual, "zero_direction", extras)
    weights = np.empty(count)
    weights[0] = sizes[0] / length
    weights[1:] = solution.multipliers * (norms[0] / norms[1:]) / length
    return WeighResult(torch.from_numpy(weights), solution.kkt_residual, extras=extras)


def _solve(
    coordinates: np.ndarray, sizes: np.ndarray, taus: np.ndarray, precision: _Precision
) -> _Solution | None:
    """min 1/2 ||y - t||^2 s.t. u_j . y >= b_j = tau_j a_j (t = a_1 u_1), or None when
    infeasible within ``precision``.

    ``coordinates`` (r x K) hold the unit vectors u_i as columns (u_1 first). With
    y = t + z this is least-distance programming, min ||z|| s.t. U^T z >= h = b - U^T t,
    solved by one NNLS (Lawson and Hanson 1974, ch. 23): x >= 0 minimizing
    ||[U; h^T] x - e||, residual rho. Then z = U lambda with lambda = x / ||rho||^2, read
    off rho (an orthogonal residual, no cancellation however large lambda). The
    constraints are infeasible iff some x >= 0 has U x = 0 and b . x > 0 (Farkas); NNLS
    finds such an x when there is one, and ||U x|| <= resolution sum_j x_j means moving
    each u_j by the coordinates' resolution makes it one. NNLS terminates where an
    active set on the dual may cycle (more constraints than dimensions).
    """
    target = sizes[0] * coordinates[:, 0]
    usable = sizes[1:] > 0  # an underflowed a_j makes its constraint 0 >= 0
    columns = coordinates[:, 1:][:, usable]
    bounds = taus[usable] * sizes[1:][usable]
    system = np.vstack([columns, bounds - columns.T @ target])
    goal = np.zeros(len(system))
    goal[-1] = -1.0
    x, residual = _nonnegative_least_squares(system, goal, precision.resolution)
    combination = residual[:-1]  # U x
    if bounds @ x > 0 and np.linalg.norm(combination) <= precision.resolution * x.sum():
        return None
    squared = float(residual @ residual)  # 1 - h . x at the optimum
    multipliers = np.zeros(len(sizes) - 1)
    multipliers[usable] = x / squared
    direction = target + combination / squared
    # y is summed from a_1 u_1 and lambda_j u_j, each u known to eps.
    summed = float(sizes[0]) + float(multipliers.sum())
    kkt = _kkt_residual(
        coordinates[:, 1:], taus * sizes[1:], multipliers, direction, precision.eps * summed
    )
    return _Solution(direction, multipliers, kkt, precision.resolution * summed)


def _kkt_residual(
    columns: np.ndarray,
    bounds: np.ndarray,
    multipliers: np.ndarray,
    direction: np.ndarray,
    uncertainty: float,
) -> float:
    """Largest constraint violation and complementarity |lambda_j (u_j . y - b_j)|, relative
    to ||y|| + max b (stationarity and lambda >= 0 hold by construction). ``uncertainty``
    (how far u_j . y may move with the gradients' rounding) counts as violation: a
    constraint met only within it is not known to be met."""
    if columns.shape[1] == 0:
        return 0.0
    scale = float(np.linalg.norm(direction)) + float(np.max(bounds))
    if scale == 0.0:
        return 0.0
    slack = columns.T @ direction - bounds
    violation = max(0.0, float(np.max(-slack))) + uncertainty
    complementarity = float(np.max(np.abs(multipliers * slack)))
    return max(violation / scale, complementarity / (scale * max(1.0, float(multipliers.sum()))))
