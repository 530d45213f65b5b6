"""A shared trunk with three heads on synthetic tasks that compete for a narrow bottleneck.

    python examples/multitask_mlp.py --out results/multitask_mlp [--harmonizers mgda,mean]

Two regression targets pull the 2-unit bottleneck towards opposite mixtures of the same
input directions and a classification target wants a third one, so the per-task
gradients on the trunk conflict. The training loop in :func:`train` is the part to copy:
per-task losses -> ``HarmonizedStep.solve`` (per-task gradients, the harmonizer's weights,
their sum into ``.grad``) -> step.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional

from mogradient import Amortizer, CombinableLoss, HarmonizedStep, make_harmonizer
from mogradient.plotting import plot_loss_curves

TASKS = ("regression A", "regression B", "classification")
INPUTS = 8


def make_data(samples: int, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Inputs and one target per task; A and B weigh the first two inputs with opposite signs."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, INPUTS, generator=generator)
    noise = 0.1 * torch.randn(samples, 2, generator=generator)
    target_a = (2.0 * x[:, 0] + x[:, 1] + noise[:, 0]).unsqueeze(1)
    target_b = (2.0 * x[:, 0] - 3.0 * x[:, 1] + x[:, 2] + noise[:, 1]).unsqueeze(1)
    target_c = (x[:, 2] - x[:, 3] + 0.5 * x[:, 1] > 0).long()
    return x, [target_a, target_b, target_c]


class MultiTaskMLP(nn.Module):
    """Shared trunk ending in a 2-unit bottleneck, one linear head per task."""

    def __init__(self, hidden: int = 32, bottleneck: int = 2) -> None:
        super().__init__()
        self.trunk = nn.Sequential(
            nn.Linear(INPUTS, hidden), nn.Tanh(), nn.Linear(hidden, bottleneck), nn.Tanh()
        )
        self.heads = nn.ModuleList(
            [nn.Linear(bottleneck, 1), nn.Linear(bottleneck, 1), nn.Linear(bottleneck, 2)]
        )

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        features = self.trunk(x)
        return [head(features) for head in self.heads]


def task_losses(outputs: list[torch.Tensor], targets: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(
        [
            functional.mse_loss(outputs[0], targets[0]),
            functional.mse_loss(outputs[1], targets[1]),
            functional.cross_entropy(outputs[2], targets[2]),
        ]
    )


def train(harmonizer_name: str, steps: int, batch: int, seed: int = 0) -> torch.Tensor:
    """Train one model with a harmonizer; return the per-task losses of every step."""
    torch.manual_seed(seed)
    x, targets = make_data(4096, seed)
    model = MultiTaskMLP()
    parameters = list(model.parameters())
    optimizer = torch.optim.Adam(parameters, lr=1e-2)
    # A fresh solve every step (period 1, no smoothing); period=10 would reuse the weights.
    step = HarmonizedStep(parameters, Amortizer(make_harmonizer(harmonizer_name), 1, rho=0.0))
    history = []
    for _ in range(steps):
        rows = torch.randint(len(x), (batch,))
        losses = task_losses(model(x[rows]), [target[rows] for target in targets])
        optimizer.zero_grad()
        step.solve([(1.0, CombinableLoss.separate(losses))], len(TASKS), replay=None)
        optimizer.step()
        history.append(losses.detach())
    return torch.stack(history)


def main(argv: Sequence[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/multitask_mlp"))
    parser.add_argument("--harmonizers", default="mgda,upgrad,mean", help="comma-separated")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=128)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # a tiny model: thread hand-offs cost more than they save

    curves = {}
    for name in args.harmonizers.split(","):
        curves[name] = train(name, args.steps, args.batch)
        final = curves[name][-20:].mean(dim=0)  # smooth out minibatch noise
        print(
            f"{name:<10} " + "  ".join(f"{t}: {v:.3f}" for t, v in zip(TASKS, final, strict=True))
        )
    path = plot_loss_curves(
        {name: [curve] for name, curve in curves.items()},
        args.out / "losses.png",
        title="Per-task training losses",
        objective_names=TASKS,
    )
    print(path)
    return args.out


if __name__ == "__main__":
    main()
