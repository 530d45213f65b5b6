"""The core on a logical accelerator: what a GPU user's loop hands it, it takes as CUDA would.

Stacks and losses live on the model's device while a loop keeps masks, counts and
preferences on the host; every harmonizer and the combinable-loss coefficients must
take that mix (``tests/logical_accelerator.py`` raises where a GPU raises), and give
the CPU's answer.
"""

from __future__ import annotations

import pytest
import torch
from logical_accelerator import ACCELERATOR, logical_accelerator

from mogradient import CombinableLoss, masked_mean_coefficients
from mogradient.engines import combinable_gradients
from mogradient.harmonizers import HARMONIZERS, make_harmonizer

OPTIONS = {
    "cr_mogm": {"inner": "mgda"},
    "fixed": {"weights": [1.0, 2.0, 0.5, 1.0]},
    **{name: {"seed": 0} for name in ("pcgrad", "rlw", "grad_vac", "grad_drop")},
}


def _stack(dtype: torch.dtype) -> torch.Tensor:
    """Four objectives, two of them in conflict."""
    stack = torch.randn(4, 64, generator=torch.Generator().manual_seed(0), dtype=dtype)
    stack[1] = -0.5 * stack[0] + 0.1 * stack[1]
    return stack


def _directions(name: str, stack: torch.Tensor) -> list[torch.Tensor]:
    """Two calls (stateful harmonizers use their state on the second), on the host."""
    torch.manual_seed(0)  # harmonizers that draw from the global generator
    harmonizer = make_harmonizer(name, **OPTIONS.get(name, {}))
    return [harmonizer(stack).direction.cpu() for _ in range(2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(HARMONIZERS))
def test_every_harmonizer_takes_a_stack_on_the_accelerator(name: str, dtype) -> None:
    stack = _stack(dtype)
    expected = _directions(name, stack)
    with logical_accelerator() as device:
        torch.manual_seed(0)
        harmonizer = make_harmonizer(name, **OPTIONS.get(name, {}))
        results = [harmonizer(stack.to(device)) for _ in range(2)]
        assert all(result.direction.device == ACCELERATOR for result in results)
        got = [result.direction.cpu() for result in results]
    # Some paths pick their kernels by device (numpy on the CPU, batched elsewhere):
    # round-off of a K x D reduction and a small solve apart.
    eps = torch.finfo(dtype).eps
    for direction, want in zip(got, expected, strict=True):
        torch.testing.assert_close(direction, want, rtol=1e4 * eps, atol=1e4 * eps)


def test_host_masks_and_counts_meet_values_on_the_accelerator() -> None:
    """The first CUDA step's crash: counts kept on the host, compared with a device mask."""
    per_sample = torch.rand(2, 2, 3, generator=torch.Generator().manual_seed(0))
    valid = torch.tensor([[True, False, True], [True, True, False]])
    counts = torch.tensor([4, 3])  # this piece is part of a larger step
    expected = masked_mean_coefficients(per_sample, valid, counts)
    with logical_accelerator() as device:
        got = masked_mean_coefficients(per_sample.to(device), valid, counts)
        assert got.device == ACCELERATOR
        got = got.cpu()
    assert torch.equal(got, expected)


def test_combinable_gradients_of_a_model_on_the_accelerator() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    inputs = torch.randn(5, 3)

    def gradients(device: torch.device) -> torch.Tensor:
        terms = model.to(device)(inputs.to(device)).T  # J = 2 terms x B = 5 samples
        coefficients = torch.rand(3, 2, 5, generator=torch.Generator().manual_seed(1))
        loss = CombinableLoss(terms, coefficients.to(device))
        return combinable_gradients(loss, list(model.parameters())).cpu()

    expected = gradients(torch.device("cpu"))
    with logical_accelerator() as device:
        got = gradients(device)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
