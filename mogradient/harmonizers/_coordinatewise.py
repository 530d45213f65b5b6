"""The shared contract of methods that combine the gradients coordinate by coordinate.

Their direction is not a weighted sum of the gradients, so it needs the stack, and the
weights they report are a stand-in: the least-squares w with J^T w closest to d, which
reproduce only d's part in the gradients' span. ``direction_is_weighted_sum`` is False,
so an :class:`~mogradient.amortize.Amortizer` refuses them.
"""

from __future__ import annotations

from abc import abstractmethod

import numpy as np
import torch

from mogradient._gram import CosineGram
from mogradient._span import coordinates_from_stack
from mogradient.harmonizers.base import Harmonization, Harmonizer, WeighResult

# Columns processed at a time (bounds the float64 copies of a long stack).
SPAN_COLUMNS = 1 << 20


class CoordinatewiseHarmonizer(Harmonizer):
    """A harmonizer whose direction is computed on the stack, coordinate by coordinate.

    Subclasses implement :meth:`direction_of`. The result's ``extras`` say what the
    weights are: ``"weights": "least_squares"`` and ``"weights_residual"``, the relative
    distance ||J^T w - d|| / ||d|| (0 only when d lies in the gradients' span).
    """

    direction_is_weighted_sum = False
    needs_stack = True
    _stack_given = False

    def __call__(
        self, jacobian: torch.Tensor | None = None, *, gram: torch.Tensor | None = None
    ) -> Harmonization:
        if gram is not None:
            raise ValueError(
                f"{type(self).__name__} combines the gradients coordinate by coordinate, which "
                "their Gram matrix cannot tell: pass the K x D gradient stack, "
                f"{type(self).__name__}()(jacobian), not gram="
            )
        self._stack_given = True
        try:
            return super().__call__(jacobian)
        finally:
            self._stack_given = False

    def weigh(self, gram: CosineGram, objectives: torch.Tensor) -> WeighResult:
        """A placeholder that :meth:`refine` replaces; refused outside a call on a stack."""
        if not self._stack_given:
            raise ValueError(
                f"{type(self).__name__} needs the gradient stack, not weights on a Gram "
                "matrix: call it on the K x D stack (it cannot be wrapped by a Gram-only "
                "harmonizer such as RewardDropout)"
            )
        return WeighResult(torch.zeros(len(objectives), dtype=torch.float64))

    def refine(
        self,
        jacobian: torch.Tensor,
        objectives: torch.Tensor,
        gram: CosineGram,
        weighting: WeighResult,
    ) -> WeighResult:
        rows = jacobian[objectives.to(jacobian.device)]
        direction = self.direction_of(rows, objectives)
        weights, residual = least_squares_weights(rows, direction)
        return WeighResult(
            weights,
            extras={"weights": "least_squares", "weights_residual": residual},
            direction=direction,
        )

    @abstractmethod
    def direction_of(self, rows: torch.Tensor, objectives: torch.Tensor) -> torch.Tensor:
        """The direction for the usable gradients ``rows`` (K' x D, finite, non-zero), in
        their dtype and on their device; ``objectives`` are their indices in the caller's
        numbering."""


def least_squares_weights(
    rows: torch.Tensor, direction: torch.Tensor
) -> tuple[torch.Tensor, float]:
    """The minimum-norm w minimizing ||rows^T w - direction||, and that distance / ||direction||.

    Solved on a QR of the unit rows (unit rows^T = Q R), so each weight is exact in its
    gradient's own units at any spread of norms; directions of R below round-off
    (near-dependent gradients) are left out by the least-squares cutoff.
    """
    basis, coordinates, norms = coordinates_from_stack(rows)
    target = direction.detach().to(dtype=torch.float64, device=basis.device)
    projected = basis.T @ target
    size = float(torch.linalg.vector_norm(target))
    residual = float(torch.linalg.vector_norm(target - basis @ projected)) / size if size else 0.0
    cutoff = len(norms) * np.finfo(float).eps
    on_units = np.linalg.lstsq(coordinates, projected.cpu().numpy(), rcond=cutoff)[0]
    return torch.from_numpy(on_units / norms), residual
