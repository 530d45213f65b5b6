"""GradDrop: per coordinate, keep the gradients of one randomly chosen sign."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar

import torch

from mogradient.harmonizers._base import seeded_generator
from mogradient.harmonizers._coordinatewise import (
    SPAN_COLUMNS,
    CoordinatewiseHarmonizer,
    headroom,
)


class GradDrop(CoordinatewiseHarmonizer):
    """Gradient sign dropout (Chen et al. 2020, Just Pick a Sign: Gradient Sign Dropout).

    The paper's procedure as TorchJD and LibMTL implement it (no code from the authors was
    found): per coordinate, the positive sign purity
    P = (1 + sum_k g_k / sum_k |g_k|) / 2 is the chance of keeping the positive values;
    with U ~ Uniform(0, 1) drawn per coordinate, the mask is
    ``M_k = [f(P) > U][g_k > 0] + [f(P) < U][g_k < 0]`` (Iverson brackets) and the update is
    sum_k (l_k + (1 - l_k) M_k) g_k with leaks l_k (default 0). ``purity_map`` is the
    paper's f (default: identity). With zero leaks every coordinate of the update sums
    gradient values of a single sign, chosen with probability f(P); nothing keeps the
    update free of conflict across coordinates. Needs the stack; the weights are
    least-squares stand-ins (`mogradient.harmonizers._coordinatewise`).

    Applied here to parameter gradients, as TorchJD does; the paper applies it to the
    gradients at an activation layer. U is drawn in float64 from a private generator
    (``seed``; ``state_dict`` replays it), one value per coordinate, and the update is
    summed in float64 and rounded once to the stack's dtype. Leaks are given per
    objective in the caller's numbering.
    """

    randomized: ClassVar[bool] = True

    def __init__(
        self,
        purity_map: Callable[[torch.Tensor], torch.Tensor] | None = None,
        leak: Sequence[float] | torch.Tensor | None = None,
        seed: int | None = None,
    ) -> None:
        if leak is not None:
            leak = torch.as_tensor(leak, dtype=torch.float64).detach().cpu().clone()
            if leak.ndim != 1 or not ((leak >= 0) & (leak <= 1)).all():
                raise ValueError("leak must be a 1-D list of numbers in [0, 1], one per objective")
        self.purity_map = purity_map
        self.leak = leak
        self.seed = seed
        self._generator = seeded_generator(seed)

    def direction_of(self, rows: torch.Tensor, objectives: torch.Tensor) -> torch.Tensor:
        leaks = torch.zeros(len(rows), dtype=torch.float64)
        if self.leak is not None:
            if int(objectives.max()) >= len(self.leak):
                raise ValueError(
                    f"got objective index {int(objectives.max())} but only {len(self.leak)} "
                    "leak values; give one per objective"
                )
            leaks = self.leak[objectives.cpu()]
        leaks = leaks.to(rows.device)[:, None]
        draws = torch.rand(rows.shape[1], generator=self._generator, dtype=torch.float64)
        draws = draws.to(rows.device)
        scale = headroom(rows, len(rows))
        direction = torch.empty(rows.shape[1], dtype=rows.dtype, device=rows.device)
        for start in range(0, rows.shape[1], SPAN_COLUMNS):
            values = rows[:, start : start + SPAN_COLUMNS].to(torch.float64) * scale
            total, size = values.sum(dim=0), values.abs().sum(dim=0)
            # A column of zeros contributes nothing whatever its purity.
            purity = 0.5 * (1 + torch.where(size > 0, total / size, 0.0))
            chance = purity if self.purity_map is None else self.purity_map(purity)
            draw = draws[start : start + SPAN_COLUMNS]
            mask = ((chance > draw) & (values > 0)) | ((chance < draw) & (values < 0))
            kept = leaks + (1 - leaks) * mask
            direction[start : start + SPAN_COLUMNS] = (kept * values).sum(dim=0) / scale
        return direction
