"""The small seeded model the LibMTL parity checks drive (tests/scalarizations/libmtl.py
against LibMTL 1.1.5, tools/libmtl_main_parity.py against its GitHub main): both sides get
two copies of it, the same batches and the same steps."""

from __future__ import annotations

import torch
from torch import nn

TASKS = 3


class Model(nn.Module):
    """A seeded Linear + tanh trunk and K linear heads, with what LibMTL's driver binds to
    (the trunk is the shared parameters); MSE loss per task."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(3, 5).to(dtype)
        self.heads = nn.ModuleList(nn.Linear(5, 1).to(dtype) for _ in range(TASKS))

    def shared_parameters(self) -> list[torch.Tensor]:
        return list(self.trunk.parameters())

    def losses(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        features = torch.tanh(self.trunk(inputs))
        return torch.stack(
            [
                ((head(features).squeeze(1) - target) ** 2).mean()
                for head, target in zip(self.heads, targets, strict=True)
            ]
        )


def batches(dtype: torch.dtype, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` seeded batches whose task losses differ by ~100x, so every method reweighs."""
    generator = torch.Generator().manual_seed(1)
    scales = torch.tensor([1.0, 3.0, 10.0], dtype=torch.float64)[:, None]
    return [
        (
            torch.randn(16, 3, generator=generator, dtype=torch.float64).to(dtype),
            (torch.randn(TASKS, 16, generator=generator, dtype=torch.float64) * scales).to(dtype),
        )
        for _ in range(count)
    ]
