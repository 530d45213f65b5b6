"""Per-objective weights on the probability simplex, for methods that carry them across steps."""

from __future__ import annotations

import torch


def project_to_simplex(point: torch.Tensor) -> torch.Tensor:
    """The Euclidean projection of a finite vector onto {x >= 0, sum x = 1}.

    Sort-based (Held, Wolfe and Crowder 1974): with the entries sorted decreasingly and
    c_j their partial sums, the threshold is tau = (c_r - 1) / r for the largest r with
    u_r > (c_r - 1) / r, and the projection is max(point - tau, 0).
    """
    # The projection ignores a common shift; subtracting the largest entry (exact for it)
    # keeps c_1 - 1 from rounding to c_1 when the entries are huge.
    point = point - point.max()
    ordered = torch.sort(point, descending=True).values
    thresholds = (torch.cumsum(ordered, dim=0) - 1.0) / torch.arange(
        1, len(point) + 1, dtype=point.dtype, device=point.device
    )
    support = int(torch.nonzero(ordered > thresholds).max())
    return (point - thresholds[support]).clamp_min(0.0)


class ObjectiveWeights:
    """Simplex weights keyed by the caller's objective indices.

    An objective left out for a step (zero or non-finite gradient) keeps its stored weight
    for when it returns. The weights of the objectives present are their stored values,
    an objective never seen starting at 1/K' (K' objectives present), rescaled to sum to 1.
    """

    def __init__(self) -> None:
        self.values: dict[int, float] = {}

    def of(self, objectives: list[int]) -> torch.Tensor:
        start = 1.0 / len(objectives)
        weights = torch.tensor(
            [self.values.get(name, start) for name in objectives], dtype=torch.float64
        )
        total = float(weights.sum())
        if total <= 0.0:
            return torch.full_like(weights, start)
        return weights if total == 1.0 else weights / total

    def set(self, objectives: list[int], weights: torch.Tensor) -> None:
        self.values.update(zip(objectives, weights.tolist(), strict=True))
