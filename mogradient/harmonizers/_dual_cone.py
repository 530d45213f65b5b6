"""What the dual-cone methods (UPGrad, DualProj) share: the cone QP's matrix, the ridge
option, and the refinement of near-dependent gradients on the stack."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from mogradient._gram import CosineGram
from mogradient._qp_cone import near_dependent, project_many_in_span
from mogradient._span import coordinates_from_stack
from mogradient.harmonizers._base import WeighResult


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
    lowers: np.ndarray | list[np.ndarray],
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
    for part_weights, part, part_residual in project_many_in_span(coordinates, norms, lowers):
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
