"""DualProj: the (preference-weighted) mean gradient projected onto the gradients' dual cone."""

from __future__ import annotations

from typing import ClassVar

import torch

from mogradient._gram import CosineGram
from mogradient._qp_cone import solve_cone_qp_factored
from mogradient.harmonizers._base import (
    Harmonizer,
    WeighResult,
    preferences_for,
    validated_flag,
    validated_preferences,
)
from mogradient.harmonizers._dual_cone import cone_problem, refined_on_stack, validated_reg_eps
from mogradient.harmonizers.promises import (
    LINEAR_UNDER_SCALING,
    NON_CONFLICTING,
    PERMUTATION_INVARIANT,
    STATIONARY_ZERO,
)


class DualProj(Harmonizer):
    """Project the averaged gradient onto the dual cone (Lopez-Paz & Ranzato 2017, GEM eq. 11).

    The direction is the closest vector to sum_k p_k g_k (default p_k = 1/K) that has a
    non-negative inner product with every gradient, i.e. J^T v with
    v = argmin v^T G v s.t. v >= p, solved exactly on the Gram matrix.
    ``reg_eps > 0`` reproduces TorchJD's default projector (G / trace(G) + reg_eps * I;
    TorchJD uses 1e-4); the default 0 is exact. ``refine`` as in
    [`UPGrad`][mogradient.harmonizers.UPGrad].
    """

    promises: ClassVar[frozenset[str]] = frozenset(
        {NON_CONFLICTING, PERMUTATION_INVARIANT, LINEAR_UNDER_SCALING, STATIONARY_ZERO}
    )

    def __init__(
        self,
        pref_vector: list[float] | torch.Tensor | None = None,
        reg_eps: float = 0.0,
        backend: str = "builtin",
        refine: bool = True,
    ) -> None:
        self.pref_vector = validated_preferences(pref_vector, "pref_vector")
        self.reg_eps = validated_reg_eps(reg_eps)
        self.backend = backend
        self.refine_on_stack = validated_flag(refine, "refine")

    def weigh(self, gram: CosineGram, objectives: torch.Tensor) -> WeighResult:
        lower = preferences_for(self.pref_vector, objectives).numpy()
        cosines, norms = cone_problem(gram, self.reg_eps)
        solution = solve_cone_qp_factored(cosines, norms, lower, backend=self.backend)
        return WeighResult(torch.from_numpy(solution.weights), kkt_residual=solution.kkt_residual)

    def refine(
        self,
        jacobian: torch.Tensor,
        objectives: torch.Tensor,
        gram: CosineGram,
        weighting: WeighResult,
    ) -> WeighResult | None:
        lower = preferences_for(self.pref_vector, objectives).numpy()
        return refined_on_stack(self, jacobian, objectives, gram, [lower])
