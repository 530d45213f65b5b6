"""Exponential moving average of harmonizer weights, MARBLE's stabilizer between full solves."""

from __future__ import annotations

import torch


class WeightEMA:
    """``ema = rho * ema + (1 - rho) * new``, renormalized; the first update is taken as is.

    Smoothing is done on simplex-like weights (e.g. MGDA's alpha); renormalization keeps
    their sum at the new weights' sum. Objectives absent from an update (weight
    exactly zero because they were dropped) keep decaying towards zero.
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
        if smoothed.sum() != 0 and weights.sum() != 0:
            smoothed = smoothed * (weights.sum() / smoothed.sum())
        self.value = smoothed
        return smoothed.clone()

    def state_dict(self) -> dict[str, object]:
        return {"rho": self.rho, "value": None if self.value is None else self.value.clone()}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.rho = float(state["rho"])  # type: ignore[arg-type]
        value = state["value"]
        self.value = None if value is None else torch.as_tensor(value, dtype=torch.float64)
