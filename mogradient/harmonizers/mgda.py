"""MGDA, by default with MARBLE's normalize-and-rescale."""

from __future__ import annotations

from typing import ClassVar

import torch

from mogradient._gram import CosineGram
from mogradient._qp import solve_simplex_qp_factored
from mogradient.harmonizers.base import (
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
    and the direction is rescaled to the mean raw norm m: d = m * sum alpha_k u_k, i.e.
    raw weights w_k = m * alpha_k / ||g_k||. With ``normalize=False`` it is plain MGDA
    (w = alpha). ``preferences`` tilt the simplex solution (alpha_k proportional to
    p_k * alpha_k*), ``alpha_floor`` mixes in a uniform share so every alpha_k >= floor;
    both trade the non-conflict guarantee for control and are off by default.
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
    ) -> None:
        if not 0.0 <= alpha_floor < 1.0:
            raise ValueError(f"alpha_floor must be in [0, 1), got {alpha_floor}")
        self.normalize = validated_flag(normalize, "normalize")
        self.preferences = validated_preferences(preferences, "preferences")
        self.alpha_floor = float(alpha_floor)
        self.backend = backend

    def weigh(self, gram: CosineGram, objectives: torch.Tensor) -> WeighResult:
        norms = gram.norms
        qp_norms = torch.ones_like(norms) if self.normalize else norms
        solution = solve_simplex_qp_factored(
            gram.cosines.numpy(), qp_norms.numpy(), backend=self.backend
        )
        alpha = self._adjusted(torch.from_numpy(solution.weights), objectives)
        weights = norms.mean() * alpha / norms if self.normalize else alpha
        return WeighResult(
            weights, kkt_residual=solution.kkt_residual, extras={"alpha": alpha.tolist()}
        )

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
