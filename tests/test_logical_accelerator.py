"""The logical accelerator raises where a GPU raises, and computes what the CPU computes.

Each rule is checked both ways: the mix a GPU refuses raises ``DeviceMismatch``, the
mix it accepts runs and gives the CPU's values.
"""

from __future__ import annotations

import copy

import pytest
import torch
from logical_accelerator import (
    ACCELERATOR,
    AcceleratorTensor,
    DeviceMismatch,
    logical_accelerator,
)
from torch import nn


def test_moved_tensors_report_the_accelerator_and_keep_their_values() -> None:
    values = torch.randn(5, generator=torch.Generator().manual_seed(0))
    with logical_accelerator() as device:
        moved = values.to(device)
        assert isinstance(moved, AcceleratorTensor) and moved.device == ACCELERATOR
        result = (moved * 2 + 1).exp().sum()
        assert result.device == device
        assert result.item() == (values * 2 + 1).exp().sum().item()
        back = result.cpu()
    assert type(back) is torch.Tensor and back.device.type == "cpu"


def test_factories_with_the_device_make_accelerator_tensors() -> None:
    with logical_accelerator() as device:
        made = [
            torch.zeros(3, device=device),
            torch.arange(4, device=device),
            torch.tensor([1.0, 2.0], device=device),
            torch.full((2,), 7, device=device),
        ]
        assert all(t.device == device for t in made)
        assert made[2].tolist() == [1.0, 2.0]


def test_a_host_tensor_meeting_an_accelerator_tensor_raises_as_on_a_gpu() -> None:
    """The first CUDA step's crash: CPU counts compared with a mask on the GPU."""
    with logical_accelerator() as device:
        valid = torch.tensor([[True, False, True], [True, True, True]]).to(device)
        counts = torch.tensor([2, 3])
        with pytest.raises(DeviceMismatch, match="same device"):
            counts < valid.sum(dim=1)  # noqa: B015
        assert bool((counts.to(device) <= valid.sum(dim=1)).all())


def test_cpu_scalars_mix_with_accelerator_tensors() -> None:
    with logical_accelerator() as device:
        values = torch.ones(3, device=device)
        assert (values * torch.tensor(2.0)).tolist() == [2.0, 2.0, 2.0]
        with pytest.raises(DeviceMismatch):
            values * torch.tensor([2.0])  # a one-element vector is no scalar


def test_indices_may_stay_on_the_host_but_values_may_not() -> None:
    with logical_accelerator() as device:
        values = torch.arange(6.0, device=device)
        assert values[torch.tensor([0, 5])].tolist() == [0.0, 5.0]
        values[torch.tensor([1])] = torch.tensor(9.0)  # a CPU scalar value
        with pytest.raises(DeviceMismatch):
            values[torch.tensor([1, 2])] = torch.tensor([3.0, 4.0])
        with pytest.raises(DeviceMismatch, match="indices should be"):
            torch.arange(6.0)[torch.tensor([0]).to(device)]


def test_random_accelerator_data_from_a_host_generator_raises() -> None:
    generator = torch.Generator().manual_seed(0)
    with logical_accelerator() as device:
        with pytest.raises(DeviceMismatch, match="generator"):
            torch.randn(3, generator=generator, device=device)
        drawn = torch.randn(3, generator=generator).to(device)  # drawn on the host, moved
        assert drawn.device == device


def test_numpy_of_an_accelerator_tensor_fails() -> None:
    with logical_accelerator() as device, pytest.raises(TypeError):
        torch.ones(2, device=device).numpy()


def test_a_module_trains_on_the_accelerator_as_on_the_cpu() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    inputs = torch.randn(16, 4)
    reference = copy.deepcopy(model)

    def train(module: nn.Module, batch: torch.Tensor) -> list[torch.Tensor]:
        optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
        for _ in range(3):
            module(batch).square().mean().backward()
            nn.utils.clip_grad_norm_(module.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
        return [p.detach().cpu() for p in module.parameters()]

    expected = train(reference, inputs)
    with logical_accelerator() as device:
        model.to(device)
        assert all(isinstance(p, nn.Parameter) and p.device == device for p in model.parameters())
        trained = train(model, inputs.to(device))
        with pytest.raises(DeviceMismatch):
            model(inputs)  # host inputs into a model on the accelerator
    for got, want in zip(trained, expected, strict=True):
        assert torch.equal(got, want)


def test_packed_sequences_keep_their_lengths_on_the_host() -> None:
    """CUDA's contract: a packed sequence's lengths (and so its batch sizes) are on the CPU."""
    torch.manual_seed(0)
    gru = nn.GRU(3, 4, batch_first=True)
    inputs, lengths = torch.randn(2, 5, 3), torch.tensor([5, 2])

    def run(module: nn.GRU, batch: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(batch, lengths, batch_first=True)
        return module(packed)[1]

    expected = run(gru, inputs)
    with logical_accelerator() as device:
        got = run(gru.to(device), inputs.to(device))
        assert got.device == device
        got = got.cpu()
    # nn.GRU picks its path by device type: float32 round-off apart (1 ulp measured).
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_a_saved_accelerator_tensor_loads_on_the_host_weights_only(tmp_path) -> None:
    """As torch.save of a GPU tensor read back with map_location='cpu': plain data, which
    the safe unpickler accepts (checkpoints are loaded weights-only)."""
    values = torch.arange(4.0)
    with logical_accelerator() as device:
        torch.save({"x": values.to(device)}, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt", map_location="cpu", weights_only=True)
    assert type(loaded["x"]) is torch.Tensor and torch.equal(loaded["x"], values)
