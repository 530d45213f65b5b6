"""What several scalarization test files share: loss rows and float64 checks, finite
differences, the TorchJD comparison, and a fixed tiny model for the gradient-based methods
stepped against a reference written out in numpy."""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest
import torch
from tolerances import chain_atol, eps
from torch import nn

from mogradient.scalarizations import Scalarization

F64 = torch.float64
# Each reference value below is a few dozen float64 operations (exp/log within an ulp,
# K-term sums) away from the same inputs along another order: 64 ulps of the result's
# scale covers that. A wrong formula is off by O(1) of the scale.
ULPS = 64
LOSS_SEQUENCE = np.array(
    [[2.0, 0.5, 1.2], [1.6, 0.45, 1.1], [1.1, 0.44, 0.9], [0.9, 0.40, 0.85], [0.7, 0.39, 0.6]]
)


def as_losses(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64, requires_grad=True)


def assert_close(actual, expected, ulps: float = ULPS) -> None:
    expected = np.asarray(expected, dtype=np.float64)
    actual = np.asarray(torch.as_tensor(actual, dtype=F64).detach())
    scale = max(1.0, float(np.max(np.abs(expected))))
    np.testing.assert_allclose(actual, expected, rtol=0, atol=chain_atol(F64, scale, ulps))


def loss_gradient(method: Scalarization, values) -> tuple[float, np.ndarray, np.ndarray]:
    """The scalarized loss, its autograd gradient w.r.t. the losses, and the reported weights."""
    losses = as_losses(values)
    result = method(losses)
    (gradient,) = torch.autograd.grad(result.loss, losses)
    return float(result.loss.detach()), gradient.numpy(), result.weights.numpy()


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


# --- finite differences -----------------------------------------------------------------

FD_POINT = np.array([1.3, 0.6, 2.2])
FD_STEP = 1e-5


def central_differences(function, point: np.ndarray, step: float) -> np.ndarray:
    rows = []
    for index in range(len(point)):
        shift = np.zeros_like(point)
        shift[index] = step
        rows.append((function(point + shift) - function(point - shift)) / (2 * step))
    return np.array(rows)


def scalarized(method: Scalarization):
    """The method's loss as a function of the loss values (numpy in, float out)."""

    def function(x: np.ndarray) -> float:
        return float(method(torch.tensor(x, dtype=F64)).loss.detach())

    return function


def assert_matches_finite_differences(
    method: Scalarization, function=None, point: np.ndarray = FD_POINT
) -> None:
    """The autograd gradient of the method's loss at ``point`` against central differences
    of ``function`` (by default the method's loss itself)."""
    loss, gradient, _ = loss_gradient(method, point)
    function = scalarized(method) if function is None else function
    # Central differences err by |f'''| h^2 / 6 (|f'''| < 100 for these losses in
    # [0.6, 2.2] and settings) plus rounding, 2 eps |f| / h per evaluation pair.
    atol = 100 * FD_STEP**2 / 6 + 4 * eps(F64) * max(1.0, abs(loss)) / FD_STEP
    np.testing.assert_allclose(gradient, central_differences(function, point, FD_STEP), atol=atol)


# --- TorchJD 0.18 -----------------------------------------------------------------------


def torchjd_scalarization() -> ModuleType:
    """TorchJD's scalarizations; skips the calling test where TorchJD is not installed."""
    return pytest.importorskip("torchjd.scalarization")


def both_gradients(ours: Scalarization, theirs: nn.Module, values) -> tuple:
    mine, their = as_losses(values), as_losses(values)
    our_loss = ours(mine).loss
    their_loss = theirs(their)
    return (
        float(our_loss.detach()),
        float(their_loss.detach()),
        torch.autograd.grad(our_loss, mine)[0],
        torch.autograd.grad(their_loss, their)[0],
    )


# --- the gradient-based methods on a fixed tiny model ------------------------------------

STEPS = 5
# Reference and method evaluate the same float64 formulas in other orders (sums of <= 16
# terms, a norm, a K x K solve or sort): tens of ulps of the result's scale per step. The
# reference's state (averages, lambda, weights) evolves on its own, so the budget grows
# with the step count. A wrong formula or update order is off by O(1) of the scale.
ULPS_PER_STEP = 64


def budget(scale: float, step: int) -> float:
    return chain_atol(F64, max(1.0, scale), ULPS_PER_STEP * (step + 1))


def assert_within(actual, expected, atol: float, what: str = "") -> None:
    actual = np.asarray(torch.as_tensor(actual, dtype=F64).detach().cpu())
    expected = np.asarray(expected, dtype=np.float64)
    difference = float(np.max(np.abs(actual - expected)))
    assert difference <= atol, (what, difference, atol, actual, expected)


class Problem:
    """A fixed float64 trunk (Linear + tanh) with one linear head per task, MSE losses."""

    def __init__(self, tasks: int = 3, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(16, 3, generator=generator, dtype=F64)
        self.targets = torch.randn(tasks, 16, generator=generator, dtype=F64) * torch.arange(
            1.0, tasks + 1, dtype=F64
        ).unsqueeze(1)
        torch.manual_seed(seed)
        self.trunk = nn.Linear(3, 4).double()
        self.heads = nn.ModuleList(nn.Linear(4, 1).double() for _ in range(tasks))

    @property
    def shared(self) -> list[torch.Tensor]:
        return list(self.trunk.parameters())

    @property
    def head_parameters(self) -> list[torch.Tensor]:
        return list(self.heads.parameters())

    def losses(self) -> torch.Tensor:
        features = torch.tanh(self.trunk(self.inputs))
        return torch.stack(
            [
                ((head(features).squeeze(1) - target) ** 2).mean()
                for head, target in zip(self.heads, self.targets, strict=True)
            ]
        )


def jacobian(losses: torch.Tensor, parameters: list[torch.Tensor]) -> np.ndarray:
    """K x D gradients by plain autograd, one loss at a time (not the library's engine)."""
    rows = []
    for loss in losses:
        grads = torch.autograd.grad(loss, parameters, retain_graph=True, allow_unused=True)
        rows.append(
            torch.cat(
                [
                    (torch.zeros_like(p) if g is None else g).reshape(-1)
                    for g, p in zip(grads, parameters, strict=True)
                ]
            )
        )
    return torch.stack(rows).numpy()


def flat_grad(parameters: list[torch.Tensor]) -> np.ndarray:
    return torch.cat([p.grad.reshape(-1) for p in parameters]).numpy()


def run(method: Scalarization, problem: Problem, reference, steps: int = STEPS) -> None:
    """Step the model with the method and compare each step with ``reference(L, G, H)``.

    ``L`` are the losses, ``G`` and ``H`` the K x D gradients on the shared parameters and
    the heads; the reference returns the weights, the shared parameters' gradient, the
    heads' coefficients on ``H`` and state to compare (name: (actual, expected, scale)).
    """
    optimizer = torch.optim.SGD(
        [*problem.trunk.parameters(), *problem.heads.parameters(), *method.parameters()], lr=0.1
    )
    for step in range(steps):
        losses = problem.losses()
        shared_jacobian = jacobian(losses, problem.shared)
        head_jacobian = jacobian(losses, problem.head_parameters)
        values = losses.detach().numpy().copy()
        optimizer.zero_grad()
        result = method(losses)
        result.loss.backward()
        expected = reference(values, shared_jacobian, head_jacobian)
        scale = max(
            np.abs(shared_jacobian).sum(0).max() * np.abs(expected["heads"]).max(),
            np.abs(expected["shared"]).max(),
        )
        checks = {
            "weights": (result.weights, expected["weights"], np.abs(expected["weights"]).max()),
            "shared": (flat_grad(problem.shared), expected["shared"], scale),
            "heads": (
                flat_grad(problem.head_parameters),
                expected["heads"] @ head_jacobian,
                np.abs(head_jacobian).max() * np.abs(expected["heads"]).max(),
            ),
            **expected.get("state", {}),
        }
        for name, (actual, wanted, size) in checks.items():
            assert_within(actual, wanted, budget(float(size), step), name)
        optimizer.step()
