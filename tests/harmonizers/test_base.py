"""The base class: input validation, unusable objectives, half-precision stacks."""

from __future__ import annotations

import pytest
import torch

from mogradient import conflict_diagnostics, make_harmonizer
from mogradient.harmonizers import MGDA


@pytest.mark.parametrize("name", ["mgda", "pcgrad", "mean", "rlw"])
def test_bad_gradients_never_give_nan(name: str) -> None:
    harmonizer = make_harmonizer(name)
    jacobian = torch.randn(4, 5)
    jacobian[1, 2] = float("nan")
    jacobian[2] = float("inf")
    jacobian[3] = 0.0
    result = harmonizer(jacobian)
    assert torch.isfinite(result.direction).all() and torch.isfinite(result.weights).all()
    assert result.dropped == (1, 2, 3)
    assert result.fallback == "single_objective"
    zeros = harmonizer(torch.zeros(3, 5))
    assert zeros.fallback == "no_usable_objective"
    assert (zeros.direction == 0).all() and (zeros.weights == 0).all()


def test_single_objective_and_duplicates() -> None:
    gradient = torch.randn(1, 7, dtype=torch.float64)
    torch.testing.assert_close(MGDA()(gradient).direction, gradient[0])
    duplicated = torch.cat([gradient, gradient, -0.5 * gradient])
    result = MGDA()(duplicated)
    assert torch.isfinite(result.weights).all() and result.kkt_residual < 1e-12


def test_bad_shapes_are_named() -> None:
    with pytest.raises(ValueError, match="shape"):
        MGDA()(torch.zeros(5))
    with pytest.raises(ValueError, match="empty"):
        MGDA()(torch.zeros(0, 3))
    with pytest.raises(ValueError, match="exactly one"):
        MGDA()()
    with pytest.raises(ValueError, match="unknown harmonizer"):
        make_harmonizer("nope")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_stacks_are_measured_in_float32(dtype: torch.dtype) -> None:
    # Entries of size ~30: float16 block sums of squares would overflow (max 65504).
    reference = 30 * torch.randn(3, 20_000, generator=torch.Generator().manual_seed(0))
    half = reference.to(dtype)
    result = MGDA()(half)
    assert result.dropped == () and result.fallback is None
    expected = MGDA()(half.double())
    torch.testing.assert_close(result.weights, expected.weights, rtol=1e-4, atol=1e-6)
    record = conflict_diagnostics(result.weights, jacobian=half)
    exact = conflict_diagnostics(result.weights, jacobian=half.double())
    for k in range(3):
        assert abs(record[f"cos/{k}"] - exact[f"cos/{k}"]) < 1e-2
