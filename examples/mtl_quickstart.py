"""Drop a harmonizer into your own multi-task loop: digit class and parity from one trunk.

    python examples/mtl_quickstart.py [--steps 200]

The lines between the ``snippet`` markers are the example of docs/mtl.md, verbatim (a test
checks that they match and that this file trains). Everything around them is the usual
model, data and optimizer set-up of a multi-task script.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional


class TwoHeadNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU())
        self.heads = nn.ModuleList([nn.Linear(32, 10), nn.Linear(32, 2)])

    def forward(self, images: torch.Tensor) -> list[torch.Tensor]:
        features = self.trunk(images)
        return [head(features) for head in self.heads]


def digit_batches(steps: int, batch: int = 64, seed: int = 0):
    """(images, [class, parity]) minibatches of scikit-learn's 8x8 digits."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32) / 16.0
    labels = torch.tensor(digits.target)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        rows = torch.randint(len(labels), (batch,), generator=generator)
        yield images[rows], [labels[rows], labels[rows] % 2]


def task_losses(outputs: list[torch.Tensor], targets: list[torch.Tensor]) -> torch.Tensor:
    """Your losses, stacked: any per-task losses of any scale work."""
    return torch.stack(
        [functional.cross_entropy(out, y) for out, y in zip(outputs, targets, strict=True)]
    )


def train(steps: int, seed: int = 0) -> torch.Tensor:
    """Train with UPGrad on the shared trunk; return the per-task losses of every step."""
    torch.manual_seed(seed)
    model = TwoHeadNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = digit_batches(steps, seed=seed)
    history = []
    # snippet start
    from mogradient import HarmonizedStep
    from mogradient.harmonizers import UPGrad

    shared = list(model.trunk.parameters())  # what every task uses
    heads = [p for head in model.heads for p in head.parameters()]
    step = HarmonizedStep(shared, UPGrad())  # or MGDA(), NashMTL(), Amortizer(MGDA()), ...
    for images, targets in loader:
        optimizer.zero_grad()
        losses = task_losses(model(images), targets)  # K losses, one per task
        losses.sum().backward(inputs=heads, retain_graph=True)  # each head: its own task's
        step.solve(losses)  # the trunk: K gradients, harmonized, into .grad
        optimizer.step()
        # snippet end
        history.append(losses.detach())
    return torch.stack(history)


def main(argv: Sequence[str] | None = None) -> torch.Tensor:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    history = train(args.steps)
    first, last = history[:10].mean(dim=0), history[-10:].mean(dim=0)
    for name, start, end in zip(("class", "parity"), first, last, strict=True):
        print(f"{name:<7} loss {float(start):.3f} -> {float(end):.3f}")
    return history


if __name__ == "__main__":
    main()
