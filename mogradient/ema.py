"""Exponential moving average of harmonizer weights, MARBLE's stabilizer between full solves."""

from __future__ import annotations

import torch


class WeightEMA:
    """``ema = rho * ema + (1 - rho) * new``, renormalized; the first update is taken as is.

    The Amortizer smooths the raw-gradient weights a full solve applies. When the new
    weights have a clearly positive sum (at least half their L1 norm: MGDA, fixed
    positive weights) the smoothed ones are rescaled to that sum, so smoothing changes
    the mix and not the step size; signed weights (IMTL-G, Aligned-MTL) are blended as
    they are. Objectives absent from an update (weight zero) keep decaying towards zero.
    """

    def __init__(self, rho: float = 0.7) -> None:
        if not 0.0 <= rho < 1.0:
            raise ValueError(f"EMA rho must be in [0, 1), got {rho}")
        self.rho = float(rho)
        self.value: torch.Tensor | None = None

    def update(self, weights: torch.Tensor) -> torch.Tensor:
        """Fold in new weights and return the smoothed ones."""
        weights = torch.as_tensor(weights, dtype=torch.float64).detach().cpu()
        if not torch.isfinite(weights).all():
            raise ValueError("cannot smooth non-finite weights")
        if self.value is None or self.value.shape != weights.shape:
            self.value = weights.clone()
            return self.value.clone()
        smoothed = self.rho * self.value + (1.0 - self.rho) * weights
        if _mostly_positive(weights) and _mostly_positive(smoothed):
            smoothed = smoothed * (weights.sum() / smoothed.sum())
        self.value = smoothed
        return smoothed.clone()

    def state_dict(self) -> dict[str, object]:
        return {"rho": self.rho, "value": None if self.value is None else self.value.clone()}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.rho = float(state["rho"])  # type: ignore[arg-type]
        value = state["value"]
        self.value = None if value is None else torch.as_tensor(value, dtype=torch.float64)


def _mostly_positive(weights: torch.Tensor) -> bool:
    return bool(weights.sum() > 0.5 * weights.abs().sum())
