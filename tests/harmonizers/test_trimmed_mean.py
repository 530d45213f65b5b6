"""TrimmedMean against sort-and-trim and TorchJD."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tolerances import reduction_atol

from mogradient.harmonizers import (
    TrimmedMean,
)

from .stacks import U32, parity_stacks, relative

aggregation = pytest.importorskip("torchjd.aggregation")


def trimmed_mean_reference(stack: np.ndarray, trim: int) -> np.ndarray:
    ordered = np.sort(stack, axis=0)
    return ordered[trim : len(stack) - trim].mean(axis=0)


@pytest.mark.parametrize("trim", [0, 1, 2])
@pytest.mark.parametrize("stack", parity_stacks(), ids=lambda s: f"K{len(s)}D{s.shape[1]}")
def test_trimmed_mean_matches_sort_and_trim_and_torchjd(stack: torch.Tensor, trim: int) -> None:
    if len(stack) < 2 * trim + 1:
        with pytest.raises(ValueError, match="needs at least"):
            TrimmedMean(trim)(stack)
        return
    kept = len(stack) - 2 * trim
    result = TrimmedMean(trim)(stack)
    reference = trimmed_mean_reference(stack.numpy(), trim)
    bound = reduction_atol(torch.float64, kept, float(stack.abs().sum(dim=0).max())) / kept
    assert float(np.abs(result.direction.numpy() - reference).max()) <= bound
    assert relative(result.direction, aggregation.TrimmedMean(trim)(stack)) <= 2.0**-53
    single = stack.float()
    theirs = aggregation.TrimmedMean(trim)(single)
    bound32 = reduction_atol(torch.float32, kept, float(single.abs().sum(dim=0).max())) / kept
    assert float(
        (TrimmedMean(trim)(single).direction - theirs).abs().max()
    ) <= bound32 + U32 * float(theirs.abs().max())
