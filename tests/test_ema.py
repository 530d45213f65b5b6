"""WeightEMA."""

from __future__ import annotations

import pytest
import torch

from mogradient.ema import WeightEMA


def test_weight_ema() -> None:
    ema = WeightEMA(rho=0.7)
    first = ema.update(torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(first, torch.tensor([1.0, 0.0], dtype=torch.float64))
    second = ema.update(torch.tensor([0.0, 1.0]))
    torch.testing.assert_close(second, torch.tensor([0.7, 0.3], dtype=torch.float64))
    # Signed weights are blended, never rescaled by a near-zero or negative sum.
    signed = WeightEMA(rho=0.5)
    signed.update(torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(
        signed.update(torch.tensor([-0.99, 1.0])), torch.tensor([0.005, 0.5], dtype=torch.float64)
    )
    restored = WeightEMA()
    restored.load_state_dict(ema.state_dict())
    torch.testing.assert_close(restored.value, ema.value)
    with pytest.raises(ValueError, match="rho"):
        WeightEMA(rho=1.0)
