"""The shared contract of methods that combine the gradients coordinate by coordinate.

Their direction is not a weighted sum of the gradients, so it needs the stack, and the
weights they report are a stand-in: the least-squares w with J^T w closest to d, which
reproduce only d's part in the gradients' span. ``direction_is_weighted_sum`` is False,
so an [`Amortizer`][mogradient.amortize.Amortizer] refuses them.
"""

from __future__ import annotations

import math
from abc import abstractmethod

import numpy as np
import torch

from mogradient._finite import all_finite
from mogradient._gram import CosineGram
from mogradient._span import coordinates_from_stack
from mogradient.harmonizers._base import (
    Harmonization,
    Harmonizer,
    WeighResult,
    overflow_message,
)

# Columns processed at a time (bounds the float64 copies of a long stack).
SPAN_COLUMNS = 1 << 20


class CoordinatewiseHarmonizer(Harmonizer):
    """A harmonizer whose direction is computed on the stack, coordinate by coordinate.

    Subclasses implement `direction_of`. The result's ``extras`` say what the
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
        """A placeholder that `refine` replaces; refused outside a call on a stack."""
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
        if not all_finite(direction):
            # Summed in float64 without overflow: only a result beyond the dtype is Inf.
            raise OverflowError(overflow_message(type(self).__name__, direction.dtype))
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
    (near-dependent gradients) are left out by the least-squares cutoff. A row whose
    weight would leave float64's range (a subnormal row beside normal ones: its share of
    d over a norm of 1e-310) gets weight zero and the others are fitted without it; the
    distance says what the weights then miss.
    """
    basis, coordinates, norms = coordinates_from_stack(rows)
    target = direction.detach().to(dtype=torch.float64, device=basis.device)
    projected = (basis.T @ target).cpu().numpy()
    cutoff = len(norms) * np.finfo(float).eps
    kept = np.ones(len(norms), dtype=bool)
    while True:
        on_units = _fitted_on_units(coordinates, projected, kept, cutoff)
        with np.errstate(over="ignore"):
            weights = on_units / norms
        overflowed = ~np.isfinite(weights)
        if not overflowed.any():
            break
        kept &= ~overflowed
    fitted = torch.from_numpy(coordinates @ on_units).to(basis.device)
    # In units of the largest entry: a float64 direction near 1e308 has no float64 norm.
    peak = float(target.abs().max())
    if peak == 0:
        return torch.from_numpy(weights), 0.0
    size = float(torch.linalg.vector_norm(target / peak))
    residual = float(torch.linalg.vector_norm((target - basis @ fitted) / peak)) / size
    return torch.from_numpy(weights), residual


def headroom(rows: torch.Tensor, count: int) -> float:
    """A power of two that a sum of ``count`` of the rows' values is scaled by in float64.

    Why: float64 rows near 1e308 overflow in a sum whose mean (or whose exact value) is
    representable. 2^-ceil(log2 count) where the largest value leaves no room for the sum,
    else 1 (a scale would cost subnormal values bits); scaling back is exact.
    """
    if count < 2 or torch.finfo(rows.dtype).max < 1e300:
        return 1.0  # narrower dtypes' sums cannot overflow float64
    shift = math.ceil(math.log2(count))
    if float(rows.abs().max()) < math.ldexp(1.0, 1023 - shift):
        return 1.0
    return math.ldexp(1.0, -shift)


def _fitted_on_units(
    coordinates: np.ndarray, projected: np.ndarray, kept: np.ndarray, cutoff: float
) -> np.ndarray:
    """Least-squares coefficients on the kept unit rows (zero on the others)."""
    on_units = np.zeros(len(kept))
    if kept.any():
        on_units[kept] = np.linalg.lstsq(coordinates[:, kept], projected, rcond=cutoff)[0]
    return on_units
