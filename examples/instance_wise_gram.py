"""Instance-wise risk minimization: every sample's loss an objective, weighted from the
Gram of per-sample gradients, which the per-row engine gets without forming them.

    python examples/instance_wise_gram.py [--steps 100]

An MLP learns scikit-learn's 8x8 digits. Each step records the forward, takes the B x B
Gram of the B per-sample losses' gradients (one backward, the per-layer factored form),
lets UPGrad weigh the samples so that no sample's loss goes up to first order, and
back-propagates the weighted losses. A test checks the Gram against per-sample gradients
formed one by one and that the loss falls.

UPGrad solves B quadratic programs of size B per step. On these Grams that takes ~5 ms at
B = 32 and 0.19-0.25 s at B = 256 (one thread; MGDA, one QP: 32-40 ms), but seconds from
B = 128 on ill-conditioned or low-rank Grams, where a solve over 1 s warns once
(docs/core/methods.md#upgrad-at-large-k): then use MGDA or a smaller batch.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional

from mogradient.combinable import CombinableLoss
from mogradient.engines import RowGradients
from mogradient.harmonizers import UPGrad


def digit_batches(steps: int, batch: int = 32, seed: int = 0):
    """(images [B, 64], labels [B]) minibatches of scikit-learn's digits."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    labels = torch.tensor(digits.target)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        rows = torch.randint(len(labels), (batch,), generator=generator)
        yield images[rows], labels[rows]


def train(steps: int, seed: int = 0) -> torch.Tensor:
    """Train with UPGrad over the samples; return the mean loss of every step."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = RowGradients(model, list(model.parameters()))
    weigh = UPGrad()
    history = []
    for images, labels in digit_batches(steps, seed=seed):
        with engine.recording():
            losses = functional.cross_entropy(model(images), labels, reduction="none")
        gram = engine.gram(CombinableLoss.instance_wise(losses), retain_graph=True)
        weights = weigh(gram=gram).weights.to(losses.dtype)
        optimizer.zero_grad()
        (weights * losses).sum().backward()
        optimizer.step()
        history.append(losses.detach().mean())
    return torch.stack(history)


def main(argv: Sequence[str] | None = None) -> torch.Tensor:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args(argv)
    history = train(args.steps)
    tenth = max(1, len(history) // 10)
    print(
        f"mean per-sample loss: first {tenth} steps {history[:tenth].mean():.3f}, "
        f"last {tenth} steps {history[-tenth:].mean():.3f}"
    )
    return history


if __name__ == "__main__":
    main()
