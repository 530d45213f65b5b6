"""PCGrad, computed on the Gram matrix so that it reports weights on the raw gradients."""

from __future__ import annotations

from typing import ClassVar

import torch

from mogradient._gram import CosineGram
from mogradient.harmonizers._base import Harmonizer, WeighResult, seeded_generator
from mogradient.harmonizers.promises import LINEAR_UNDER_SCALING


class PCGrad(Harmonizer):
    """Project conflicting gradients onto each other's normal planes (Yu et al. 2020, PCGrad).

    Every projected gradient is a linear combination of the raw ones, so we track its
    coefficients on the unit gradients and take inner products through the cosines;
    removing the part along u_j is then subtracting (v . u_j) from u_j's coefficient,
    exact at any spread of norms, and costs O(K^3) on a K x K matrix instead of passes
    over D parameters. Raw weights are those coefficients divided by the norms.
    ``reduction="sum"`` follows the paper's Algorithm 1; ``"mean"`` divides by K.
    """

    promises: ClassVar[frozenset[str]] = frozenset({LINEAR_UNDER_SCALING})

    randomized: ClassVar[bool] = True

    def __init__(self, reduction: str = "sum", seed: int | None = None) -> None:
        if reduction not in ("sum", "mean"):
            raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
        self.reduction = reduction
        self.seed = seed
        self._generator = seeded_generator(seed)

    def weigh(self, gram: CosineGram, objectives: torch.Tensor) -> WeighResult:
        count = len(objectives)
        coefficients = torch.diag(gram.norms)
        for task in range(count):
            for other in torch.randperm(count, generator=self._generator).tolist():
                if other == task:
                    continue
                dot = coefficients[task] @ gram.cosines[:, other]
                if dot < 0:
                    coefficients[task, other] -= dot
        weights = coefficients.sum(dim=0) / gram.norms
        if self.reduction == "mean":
            weights = weights / count
        return WeighResult(weights)
