"""Coordinate-wise trimmed mean: the mean of each coordinate without its extreme values."""

from __future__ import annotations

from typing import ClassVar

import torch

from mogradient.harmonizers._coordinatewise import (
    SPAN_COLUMNS,
    CoordinatewiseHarmonizer,
    headroom,
)
from mogradient.harmonizers.promises import LINEAR_UNDER_SCALING, PERMUTATION_INVARIANT


class TrimmedMean(CoordinatewiseHarmonizer):
    """Coordinate-wise trimmed mean (Yin et al. 2018, Byzantine-Robust Distributed Learning).

    The paper's coordinate-wise trimmed mean: in every coordinate the ``trim_number`` b
    largest and smallest of the K values are removed and the other K - 2b averaged.
    Each coordinate of the update lies between the (b+1)-th smallest and (b+1)-th
    largest of the gradients' values there, so b gradients cannot move it outside the
    others' range; it is no weighted sum of the gradients and gives no guarantee against
    conflict. Needs the stack and K' >= 2b + 1 usable gradients (zero or non-finite
    ones are left out, as by every harmonizer). The values are averaged in float64 and
    rounded once to the stack's dtype. The weights are least-squares stand-ins
    (`mogradient.harmonizers._coordinatewise`).
    """

    promises: ClassVar[frozenset[str]] = frozenset({PERMUTATION_INVARIANT, LINEAR_UNDER_SCALING})

    def __init__(self, trim_number: int = 1) -> None:
        if int(trim_number) != trim_number or trim_number < 0:
            raise ValueError(f"trim_number must be a non-negative integer, got {trim_number}")
        self.trim_number = int(trim_number)

    @property
    def required_objectives(self) -> int:
        """Usable gradients a call needs: one left after trimming both ends."""
        return 2 * self.trim_number + 1

    def direction_of(self, rows: torch.Tensor, objectives: torch.Tensor) -> torch.Tensor:
        count = len(rows)
        kept = count - 2 * self.trim_number
        if count < self.required_objectives:
            raise ValueError(
                f"TrimmedMean(trim_number={self.trim_number}) needs at least "
                f"{self.required_objectives} usable gradients, got {count}"
            )
        scale = headroom(rows, kept)
        direction = torch.empty(rows.shape[1], dtype=rows.dtype, device=rows.device)
        for start in range(0, rows.shape[1], SPAN_COLUMNS):
            ordered = torch.sort(rows[:, start : start + SPAN_COLUMNS], dim=0).values
            middle = ordered[self.trim_number : self.trim_number + kept].to(torch.float64)
            direction[start : start + SPAN_COLUMNS] = (middle * scale).mean(dim=0) / scale
        return direction
