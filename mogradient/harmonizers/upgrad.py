"""UPGrad: average of every gradient's projection onto the dual cone of all gradients."""

from __future__ import annotations

from typing import ClassVar, Protocol

import numpy as np
import torch

from mogradient._gram import CosineGram
from mogradient._qp_cone import near_dependent, project_in_span, solve_cone_qp_factored
from mogradient._span import coordinates_from_stack
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


class UPGrad(Harmonizer):
    """Unconflicting projection of gradients (Quinton & Rey 2024, Jacobian Descent for MOO).

    Each gradient g_i, scaled by its preference p_i (default 1/K), is projected onto the
    dual cone {d : g_k . d >= 0 for all k}; the direction is the sum of the projections,
    so it conflicts with no objective. On the Gram matrix the projection of p_i g_i is
    J^T v_i with v_i = argmin v^T G v s.t. v >= p_i e_i, and the weights are sum_i v_i.
    Every QP is solved exactly (:func:`mogradient._qp_cone.solve_cone_qp`).

    ``reg_eps > 0`` reproduces TorchJD's default projector, which solves the QP on
    G / trace(G) + reg_eps * I (TorchJD uses 1e-4); the default 0 is the exact method.
    With ``refine=True`` (default) and a gradient stack given, near-dependent gradients
    are re-solved in exact span coordinates from a QR of the stack
    (:func:`mogradient._span.coordinates_from_stack`, one O(D K^2) factorization);
    ``refine=False`` keeps the Gram-only solve, cheaper for huge D.
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
        preferences = preferences_for(self.pref_vector, objectives).numpy()
        cosines, norms = cone_problem(gram, self.reg_eps)
        weights = torch.zeros(len(objectives), dtype=torch.float64)
        residual = 0.0
        for index, preference in enumerate(preferences):
            if preference == 0:
                continue  # min v^T G v over v >= 0 is v = 0.
            lower = np.zeros(len(objectives))
            lower[index] = preference
            solution = solve_cone_qp_factored(cosines, norms, lower, backend=self.backend)
            weights += torch.from_numpy(solution.weights)
            residual = max(residual, solution.kkt_residual)
        return WeighResult(weights, kkt_residual=residual)

    def refine(
        self,
        jacobian: torch.Tensor,
        objectives: torch.Tensor,
        gram: CosineGram,
        weighting: WeighResult,
    ) -> WeighResult | None:
        lowers = [
            preference * np.eye(len(objectives))[index]
            for index, preference in enumerate(
                preferences_for(self.pref_vector, objectives).numpy()
            )
            if preference != 0
        ]
        return refined_on_stack(self, jacobian, objectives, gram, lowers)


class DualConeSettings(Protocol):
    """What decides whether a dual-cone method is refined on the stack."""

    refine_on_stack: bool
    reg_eps: float
    backend: str


def refined_on_stack(
    settings: DualConeSettings,
    jacobian: torch.Tensor,
    objectives: torch.Tensor,
    gram: CosineGram,
    lowers: list[np.ndarray],
) -> WeighResult | None:
    """The sum over ``lowers`` of dual-cone projections solved on the stack, for the exact
    method (refinement on, no TorchJD ridge, the built-in solver) when the Gram says the
    gradients are near-dependent."""
    exact = settings.refine_on_stack and settings.reg_eps == 0 and settings.backend == "builtin"
    if not (exact and near_dependent(gram.cosines.numpy())):
        return None
    basis, coordinates, norms = coordinates_from_stack(jacobian[objectives.to(jacobian.device)])
    weights = np.zeros(len(objectives))
    projection = np.zeros(coordinates.shape[0])
    residual = 0.0
    for lower in lowers:
        part_weights, part, part_residual = project_in_span(coordinates, norms, lower)
        weights += part_weights
        projection += part
        residual = max(residual, part_residual)
    direction = basis @ torch.from_numpy(projection).to(basis.device)
    return WeighResult(
        torch.from_numpy(weights),
        kkt_residual=residual,
        extras={"refined_on_stack": True},
        direction=direction.to(dtype=jacobian.dtype, device=jacobian.device),
    )


def preferences_for(preferences: torch.Tensor | None, objectives: torch.Tensor) -> torch.Tensor:
    """The usable objectives' preferences: 1/K' by default, else the configured entries.

    When some objectives were dropped the remaining preferences are rescaled to keep the
    configured total (as :class:`~mogradient.harmonizers.weighted.FixedWeights` does), so
    the update's size does not shrink with the number of objectives present.
    """
    count = len(objectives)
    if preferences is None:
        return torch.full((count,), 1.0 / count, dtype=torch.float64)
    if int(objectives.max()) >= len(preferences):
        raise ValueError(
            f"got objective index {int(objectives.max())} but only {len(preferences)} "
            "preferences; give one preference per objective"
        )
    present = preferences[objectives.cpu()].clone()
    if count < len(preferences) and present.sum() > 0:
        present = present * (preferences.sum() / present.sum())
    return present


def validated_reg_eps(reg_eps: float) -> float:
    """A finite, non-negative ridge."""
    reg_eps = float(reg_eps)
    if not (reg_eps >= 0 and reg_eps != float("inf")):
        raise ValueError(f"reg_eps must be a finite non-negative number, got {reg_eps}")
    return reg_eps


def cone_problem(gram: CosineGram, reg_eps: float) -> tuple[np.ndarray, np.ndarray]:
    """Cosines and norms of the dual-cone QP's matrix: the Gram itself, read in each
    gradient's own units, or TorchJD's G / trace(G) + reg_eps * I when ``reg_eps > 0``."""
    if reg_eps == 0:
        return gram.cosines.numpy(), gram.norms.numpy()
    matrix = gram.matrix()
    matrix = matrix / torch.trace(matrix) + reg_eps * torch.eye(len(matrix), dtype=matrix.dtype)
    norms = torch.sqrt(torch.diagonal(matrix))
    return (matrix / torch.outer(norms, norms)).numpy(), norms.numpy()
