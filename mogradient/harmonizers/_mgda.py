"""MGDA, by default with MARBLE's normalize-and-rescale."""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
import torch

from mogradient._gram import CosineGram
from mogradient._qp import solve_simplex_qp_factored
from mogradient.harmonizers._base import (
    Harmonization,
    Harmonizer,
    WeighResult,
    validated_flag,
    validated_preferences,
)
from mogradient.harmonizers.promises import (
    LINEAR_UNDER_SCALING,
    NON_CONFLICTING,
    PERMUTATION_INVARIANT,
    STATIONARY_ZERO,
)


class MGDA(Harmonizer):
    """Min-norm point of the gradients' convex hull (Désidéri 2012; normalize-rescale: MARBLE 2026).

    With ``normalize=True`` (MARBLE) the QP runs on unit gradients u_k = g_k/||g_k||
    and the direction is rescaled to the mean raw norm m over the usable objectives:
    d = m * sum alpha_k u_k, i.e. raw weights w_k = m * alpha_k / ||g_k||. With
    ``normalize=False`` it is plain MGDA (w = alpha).

    Two options are the MARBLE release's (its balancer's ``reward_weights`` and
    ``alpha_floor``), solved exactly:

    - ``unit_weights`` v (one positive number per objective; needs ``normalize=True``)
      scale the unit gradients before the solve, so they change the hull: the QP runs on
      the Gram diag(v) C diag(v) and d = m * sum alpha_k v_k u_k (raw weights
      m alpha_k v_k / ||g_k||). The direction still conflicts with no gradient.
    - ``alpha_lower_bound`` f bounds every alpha_k from below *inside* the QP: min over
      {sum alpha = 1, alpha >= f}, solved as a simplex QP in b, alpha = f + (1 - K f) b
      (`mogradient._qp.solve_simplex_qp_factored`). As in the release, a negative
      f counts as 0 and f > 1/K as 1/K (uniform alpha), K the usable objectives.

    Two are ours, applied to the solved ``alpha*``: ``preferences`` p tilt it (``alpha_k``
    proportional to ``p_k alpha_k*``), ``alpha_floor`` f mixes in a uniform share,
    ``alpha = f + (1 - K f) alpha*``, which keeps alpha's ranking (f K > 1 is refused).
    A floor of either kind, and preferences, trade the non-conflict guarantee for control;
    all are off by default, and ``promises`` are those of the default options. Options
    that would act on alpha twice (both floors; preferences with ``unit_weights`` or
    ``alpha_lower_bound``) are refused.

    ``backend`` picks the QP solver: ``"builtin"`` (the default: Wolfe's method in float64,
    exact, no dependency), ``"cvxpy"`` (cvxpy with Clarabel) or ``"qpsolvers:<solver>"``
    with any solver qpsolvers names (``"qpsolvers:quadprog"``, ``"qpsolvers:clarabel"``,
    ``"qpsolvers:daqp"``, ``"qpsolvers:proxqp"``, ``"qpsolvers:osqp"`` are installed by the
    ``solvers`` extra, ``pip install 'mogradient[solvers]'``). The external backends solve
    the same unit-scaled problem to their own tolerances, to cross-check the built-in one;
    another string fails with a ``ValueError`` at the first solve.
    """

    promises: ClassVar[frozenset[str]] = frozenset(
        {NON_CONFLICTING, PERMUTATION_INVARIANT, LINEAR_UNDER_SCALING, STATIONARY_ZERO}
    )

    def __init__(
        self,
        normalize: bool = True,
        preferences: list[float] | torch.Tensor | None = None,
        alpha_floor: float = 0.0,
        backend: str = "builtin",
        *,
        alpha_lower_bound: float = 0.0,
        unit_weights: list[float] | torch.Tensor | None = None,
    ) -> None:
        if not 0.0 <= alpha_floor < 1.0:
            raise ValueError(f"alpha_floor must be in [0, 1), got {alpha_floor}")
        self.normalize = validated_flag(normalize, "normalize")
        self.preferences = validated_preferences(preferences, "preferences")
        self.alpha_floor = float(alpha_floor)
        self.backend = backend
        self.alpha_lower_bound = _validated_lower_bound(alpha_lower_bound)
        self.unit_weights = _validated_unit_weights(unit_weights)
        if self.unit_weights is not None and not self.normalize:
            raise ValueError(
                "unit_weights scale the unit gradients and need normalize=True; with "
                "normalize=False scale the losses instead"
            )
        if self.alpha_floor > 0 and self.alpha_lower_bound > 0:
            raise ValueError(
                "alpha_floor (a uniform share mixed in after the solve) and "
                "alpha_lower_bound (a bound inside the QP) are two floors; set one"
            )
        if self.preferences is not None and (
            self.unit_weights is not None or self.alpha_lower_bound > 0
        ):
            raise ValueError(
                "preferences tilt alpha after the solve; with unit_weights or "
                "alpha_lower_bound (the release's options) weight the objectives by "
                "unit_weights instead"
            )

    def __call__(
        self, jacobian: torch.Tensor | None = None, *, gram: torch.Tensor | None = None
    ) -> Harmonization:
        given = jacobian if jacobian is not None else gram
        if (
            self.unit_weights is not None
            and given is not None
            and len(given) != len(self.unit_weights)
        ):
            raise ValueError(
                f"got {len(given)} objectives but {len(self.unit_weights)} unit_weights; "
                "give one per objective"
            )
        return super().__call__(jacobian, gram=gram)

    def weigh(self, gram: CosineGram, objectives: torch.Tensor) -> WeighResult:
        norms = gram.norms
        count = len(norms)
        scales = self._unit_weights(objectives)
        if scales is not None:
            qp_norms = scales
        else:
            qp_norms = torch.ones_like(norms) if self.normalize else norms
        floor = min(self.alpha_lower_bound, 1.0 / count)
        solution = solve_simplex_qp_factored(
            gram.cosines.numpy(), qp_norms.numpy(), backend=self.backend, floor=floor
        )
        alpha = self._adjusted(torch.from_numpy(solution.weights), objectives)
        if self.normalize:
            terms = alpha if scales is None else alpha * scales
            weights = norms.mean() * terms / norms
        else:
            weights = alpha
        extras = {"alpha": alpha.tolist()}
        if self.alpha_lower_bound > 0:
            extras["alpha_lower_bound"] = floor
        return WeighResult(weights, kkt_residual=solution.kkt_residual, extras=extras)

    def _unit_weights(self, objectives: torch.Tensor) -> torch.Tensor | None:
        """The usable objectives' unit weights (None without the option)."""
        if self.unit_weights is None:
            return None
        if int(objectives.max()) >= len(self.unit_weights):
            raise ValueError(
                f"got objective index {int(objectives.max())} but only "
                f"{len(self.unit_weights)} unit_weights; give one per objective"
            )
        return self.unit_weights[objectives.cpu()]

    def _adjusted(self, alpha: torch.Tensor, objectives: torch.Tensor) -> torch.Tensor:
        if self.preferences is not None:
            if int(objectives.max()) >= len(self.preferences):
                raise ValueError(
                    f"got {int(objectives.max()) + 1}+ objectives but only "
                    f"{len(self.preferences)} preferences; give one per objective"
                )
            tilted = alpha * self.preferences[objectives]
            alpha = tilted / tilted.sum() if tilted.sum() > 0 else alpha
        if self.alpha_floor > 0:
            count = len(alpha)
            if self.alpha_floor * count > 1:
                raise ValueError(
                    f"alpha_floor={self.alpha_floor} is infeasible for {count} objectives "
                    f"(floor x K must be <= 1)"
                )
            alpha = self.alpha_floor + (1 - self.alpha_floor * count) * alpha
        return alpha


def _validated_lower_bound(value: float) -> float:
    """A finite number, negative ones read as 0 (as the MARBLE release does)."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | float | np.number):
        raise ValueError(f"alpha_lower_bound must be a finite number, got {value!r}")
    if not math.isfinite(float(value)):
        raise ValueError(f"alpha_lower_bound must be a finite number, got {value!r}")
    return max(float(value), 0.0)


def _validated_unit_weights(weights: list[float] | torch.Tensor | None) -> torch.Tensor | None:
    """A 1-D float64 vector of finite positive numbers (or None)."""
    if weights is None:
        return None
    try:
        weights = torch.as_tensor(weights, dtype=torch.float64).detach().cpu()
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(
            f"unit_weights must be a 1-D list of finite positive numbers, got {weights!r}"
        ) from None
    if (
        weights.ndim != 1
        or len(weights) == 0
        or not torch.isfinite(weights).all()
        or (weights <= 0).any()
    ):
        raise ValueError(
            f"unit_weights must be a 1-D list of finite positive numbers, got {weights.tolist()}"
        )
    return weights.clone()
