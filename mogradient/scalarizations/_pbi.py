"""PBI: penalty-based boundary intersection, progress along a preference ray, a penalty off it."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from mogradient.scalarizations._base import (
    Scalarization,
    ScalarizedLoss,
    non_negative,
    preferences_and_reference,
)


class PBI(Scalarization):
    """Penalty-based boundary intersection (Zhang & Li 2007, MOEA/D, IEEE TEC).

    With the losses measured from a reference point z and p the unit preference
    direction, d1 = (L - z) . p is the progress along the ray and
    d2 = ||(L - z) - d1 p|| the distance from it; the loss is d1 + theta d2. Minimizing
    it drives the losses down *along the chosen ray*, which is how MOEA/D spreads its
    solutions over the front. The weights are p + theta (L - z - d1 p) / d2: a task that
    is ahead of the ray gets a negative weight (it is pushed back towards the ray).

    ``theta`` defaults to 5. ``preferences`` default to uniform, ``reference`` (an ideal
    point, a lower bound on the losses) to 0; either fixes ``num_tasks``. d1 is the signed
    projection: its absolute value gives the same loss while the losses stay above the
    reference, but would push them back up once they pass it. d2 is not differentiable
    on the ray itself: there its gradient is taken as 0 (the subgradient torch's norm
    uses), with no smoothing constant. Both are computed in units of a power of two near
    the largest loss, so d2's squares neither overflow nor underflow (float32 losses near
    1e20 or 1e-30); a loss beyond the losses' dtype raises ``OverflowError``.
    """

    def __init__(
        self,
        num_tasks: int | None = None,
        *,
        theta: float = 5.0,
        preferences: Sequence[float] | torch.Tensor | None = None,
        reference: Sequence[float] | torch.Tensor | None = None,
    ) -> None:
        num_tasks, preferences, reference = preferences_and_reference(
            num_tasks, preferences, reference
        )
        super().__init__(num_tasks)
        self.theta = non_negative(theta, "theta")
        self.register_buffer(
            "direction", None if preferences is None else preferences / preferences.norm()
        )
        self.register_buffer("reference", reference)

    def scalarize(self, losses: torch.Tensor) -> ScalarizedLoss:
        if self.direction is None:
            direction = torch.full_like(losses, len(losses) ** -0.5).detach()
        else:
            direction = self.direction.to(losses)
        excess = losses if self.reference is None else losses - self.reference.to(losses)
        # In units of a power of two near the largest |excess|: the squares inside the norm
        # neither overflow (float32 losses ~1e20) nor underflow (~1e-20), and d1's sum
        # cannot overflow where d1 does not. Powers of two are exact.
        largest = float(excess.detach().abs().max())
        scale = math.ldexp(1.0, math.frexp(largest)[1] - 1) if largest > 0 else 1.0
        along = (excess / scale) @ direction
        off = excess / scale - along * direction
        distance = torch.linalg.vector_norm(off)
        loss = (along + self.theta * distance) * scale
        if not bool(torch.isfinite(loss)):
            raise OverflowError(
                f"PBI: the loss d1 + theta d2 is beyond {str(loss.dtype).removeprefix('torch.')}'s "
                f"range (losses minus reference up to {largest:.3g}, theta {self.theta}): scale "
                "the losses down, or compute them in float64"
            )
        off, distance = off.detach(), distance.detach()
        unit = torch.where(distance > 0, off / distance, torch.zeros_like(off))
        weights = direction + self.theta * unit
        extras = {"d1": along.detach() * scale, "d2": distance * scale}
        return ScalarizedLoss(loss, weights, extras)
