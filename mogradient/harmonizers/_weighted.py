"""Gradient-independent weightings: fixed weights (weighted sum), the mean, random weights."""

from __future__ import annotations

from typing import ClassVar

import torch

from mogradient._gram import CosineGram
from mogradient.harmonizers._base import Harmonizer, WeighResult, seeded_generator
from mogradient.harmonizers.promises import LINEAR_UNDER_SCALING, PERMUTATION_INVARIANT


class FixedWeights(Harmonizer):
    """Weighted sum sum_k w_k g_k, the standard multi-reward baseline (linear scalarization).

    When some objectives are unusable (zero / non-finite gradient, or dropped by
    [`RewardDropout`][mogradient.harmonizers.RewardDropout]) the remaining weights are rescaled to
    keep the configured total magnitude (L1 norm), so the update's size does not shrink with the
    number of objectives present.
    ``weights=None`` is the plain sum: weight 1 for every objective present.
    """

    promises: ClassVar[frozenset[str]] = frozenset({LINEAR_UNDER_SCALING})

    def __init__(self, weights: list[float] | torch.Tensor | None = None) -> None:
        self.weights = None if weights is None else _checked_weights(weights)

    def weigh(self, gram: CosineGram, objectives: torch.Tensor) -> WeighResult:
        if self.weights is None:
            return WeighResult(torch.ones(len(objectives), dtype=torch.float64))
        if int(objectives.max()) >= len(self.weights):
            raise ValueError(
                f"FixedWeights has {len(self.weights)} weights but got objective index "
                f"{int(objectives.max())}; give one weight per objective"
            )
        present = self.weights[objectives]
        if len(objectives) < len(self.weights) and present.abs().sum() > 0:
            present = present * (self.weights.abs().sum() / present.abs().sum())
        return WeighResult(present.clone())


def _checked_weights(weights: list[float] | torch.Tensor) -> torch.Tensor:
    weights = torch.as_tensor(weights, dtype=torch.float64)
    if weights.ndim != 1 or len(weights) == 0 or not torch.isfinite(weights).all():
        raise ValueError("weights must be a non-empty 1-D list of finite numbers")
    return weights


class Mean(Harmonizer):
    """Average of the usable gradients (equal weights 1/K)."""

    promises: ClassVar[frozenset[str]] = frozenset({PERMUTATION_INVARIANT, LINEAR_UNDER_SCALING})

    def weigh(self, gram: CosineGram, objectives: torch.Tensor) -> WeighResult:
        count = len(objectives)
        return WeighResult(torch.full((count,), 1.0 / count, dtype=torch.float64))


class RandomWeights(Harmonizer):
    """Random loss weighting, softmax of standard normal draws each step (Lin et al. 2022, RLW)."""

    randomized: ClassVar[bool] = True

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed
        self._generator = seeded_generator(seed)

    def weigh(self, gram: CosineGram, objectives: torch.Tensor) -> WeighResult:
        logits = torch.randn(len(objectives), generator=self._generator, dtype=torch.float64)
        return WeighResult(torch.softmax(logits, dim=0))
