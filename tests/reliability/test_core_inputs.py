"""Core inputs a careless loop produces: stacks still attached to the graph, extreme scales."""

from __future__ import annotations

import pytest
import torch

from mogradient import make_harmonizer

GRAM_METHODS = ("mgda", "cagrad", "upgrad", "dual_proj", "pcgrad", "imtl_g", "nash_mtl")


@pytest.mark.parametrize("name", GRAM_METHODS)
def test_harmonizers_detach_a_stack_that_requires_grad(name: str) -> None:
    leaf = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    stack = leaf.clone().requires_grad_(True) * 2.0  # attached to a graph
    options = {"seed": 0} if name == "pcgrad" else {}
    result = make_harmonizer(name, **options)(stack)
    assert not result.direction.requires_grad
    assert result.direction.grad_fn is None
    expected = make_harmonizer(name, **options)(stack.detach()).direction
    torch.testing.assert_close(result.direction, expected, rtol=0, atol=0)


@pytest.mark.parametrize("factor", [1e20, 1e-20])
def test_float32_stack_beyond_the_gram_range_is_not_dropped(factor: float) -> None:
    """1e20 squared overflows float32 and 1e-20 squared underflows it: neither is a zero
    or a non-finite gradient, so nothing may be dropped and the direction scales exactly."""
    stack = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    base = make_harmonizer("mgda")(stack)
    scaled = make_harmonizer("mgda")(stack * factor)
    assert scaled.dropped == () and scaled.fallback is None
    # Power-of-two rescaling is exact, so weights agree to float32 Gram round-off.
    torch.testing.assert_close(scaled.weights, base.weights, rtol=1e-5, atol=0)
    torch.testing.assert_close(scaled.direction / factor, base.direction, rtol=1e-5, atol=1e-6)
