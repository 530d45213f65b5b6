"""GradDrop against its numpy rule and TorchJD."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tolerances import reduction_atol

from mogradient.harmonizers import (
    GradDrop,
)

from .stacks import U32, draws_for, graddrop_reference, parity_stacks, random_stack

aggregation = pytest.importorskip("torchjd.aggregation")


@pytest.mark.parametrize("stack", parity_stacks(), ids=lambda s: f"K{len(s)}D{s.shape[1]}")
def test_graddrop_matches_numpy_rule_and_torchjd(stack: torch.Tensor) -> None:
    """TorchJD draws U from torch's global generator in the stack's dtype: seeded alike on
    a float64 stack it draws our U and must agree to the last bit of the sums. On a
    float32 stack its U are float32 draws, so we compare with TorchJD on the same values
    in float64, which we then match up to our one rounding to float32."""
    seed = 11
    values = stack.numpy()
    leak = np.linspace(0.0, 0.5, len(stack))
    for leaks in (None, leak):
        result = GradDrop(leak=leaks, seed=seed)(stack)
        reference = graddrop_reference(values, draws_for(seed, stack.shape[1]), leaks)
        bound = reduction_atol(torch.float64, len(stack), float(np.abs(values).sum(axis=0).max()))
        assert float(np.abs(result.direction.numpy() - reference).max()) <= bound
        torch.manual_seed(seed)
        theirs = aggregation.GradDrop(leak=None if leaks is None else torch.from_numpy(leaks))(
            stack
        )
        assert float((result.direction - theirs).abs().max()) <= bound
    single = stack.float()
    ours = GradDrop(seed=seed)(single).direction
    torch.manual_seed(seed)
    theirs = aggregation.GradDrop()(single.double())
    assert float((ours.double() - theirs).abs().max()) <= U32 * float(theirs.abs().max())


def test_graddrop_replays_from_state_dict() -> None:
    stack = random_stack(2, 4, 30)
    harmonizer = GradDrop(seed=5)
    harmonizer(stack)
    state = harmonizer.state_dict()
    expected = harmonizer(stack).direction
    resumed = GradDrop(seed=123)
    resumed.load_state_dict(state)
    torch.testing.assert_close(resumed(stack).direction, expected, rtol=0, atol=0)
    assert not torch.equal(GradDrop(seed=6)(stack).direction, GradDrop(seed=5)(stack).direction)
