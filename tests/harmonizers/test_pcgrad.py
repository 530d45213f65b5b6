"""PCGrad against its explicit projection."""

from __future__ import annotations

import torch

from mogradient.harmonizers import PCGrad


def test_pcgrad_matches_explicit_projection() -> None:
    """PCGrad on two conflicting gradients projects each onto the other's normal plane."""
    first, second = (
        torch.tensor([1.0, 0.0], dtype=torch.float64),
        torch.tensor([-1.0, 1.0], dtype=torch.float64),
    )
    expected = (first - (first @ second) / (second @ second) * second) + (
        second - (second @ first) / (first @ first) * first
    )
    result = PCGrad(seed=0)(torch.stack([first, second]))
    torch.testing.assert_close(result.direction, expected)


def test_pcgrad_leaves_agreeing_gradients_alone() -> None:
    jacobian = torch.tensor([[1.0, 0.2], [0.5, 1.0], [0.3, 0.3]], dtype=torch.float64)
    torch.testing.assert_close(PCGrad(seed=1)(jacobian).weights, torch.ones(3, dtype=torch.float64))
    torch.testing.assert_close(
        PCGrad(reduction="mean", seed=1)(jacobian).weights,
        torch.full((3,), 1 / 3, dtype=torch.float64),
    )
