"""What every registered scalarization must do (parametrized over SCALARIZATIONS, split
into the loss-based methods and those that take the shared parameters or draw a
preference): weights that are the loss's gradient, state round trips, which state is a
parameter, and a tiny 2-task model trained with each method."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from mogradient.scalarizations import (
    COSMOS,
    DBMTL,
    FAMO,
    GLS,
    IMTL,
    SCALARIZATIONS,
    STCH,
    UW,
    GradNorm,
    MoCo,
    Scalarization,
    make_scalarization,
)

from .helpers import F64, LOSS_SEQUENCE, Problem, as_losses, assert_close, loss_gradient

# The loss-based methods, with the options the end-to-end test builds them with.
LOSS_BASED: dict[str, dict] = {
    "uw": {},
    "dwa": {},
    "gls": {},
    "imtl_l": {},
    "stch": {"mu": 0.1},
    "pbi": {},
    "famo": {},
}


# Methods that need the shared parameters or a drawn preference.
GRADIENT_BASED = {
    "grad_norm": lambda k, shared: GradNorm(k, shared, lr=0.1),
    "db_mtl": lambda k, shared: DBMTL(k, shared, beta_sigma=0.5),
    "moco": lambda k, shared: MoCo(k, shared, gamma=1.0),
    "imtl": lambda k, shared: IMTL(k, shared).double(),
    "cosmos": lambda k, shared: COSMOS(k, 1.0, seed=3),
}


def test_every_method_is_in_the_registry_and_the_end_to_end_test() -> None:
    assert set(LOSS_BASED) | set(GRADIENT_BASED) == set(SCALARIZATIONS)
    assert not set(LOSS_BASED) & set(GRADIENT_BASED)


def test_an_unknown_name_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown scalarization 'nope'"):
        make_scalarization("nope")


@pytest.mark.parametrize("name", sorted(LOSS_BASED))
def test_weights_are_the_gradient_of_the_loss(name: str) -> None:
    values = [1.3, 0.6, 2.2]
    method = make_scalarization(name, num_tasks=3, **LOSS_BASED[name]).double()
    if name in ("uw", "imtl_l"):
        with torch.no_grad():
            next(method.parameters()).copy_(torch.tensor([0.2, -0.4, 0.1]))
    _, gradient, weights = loss_gradient(method, values)
    assert_close(weights, gradient)


# --- state ------------------------------------------------------------------------------


def advance_on_losses(method: Scalarization, rows: np.ndarray) -> list[float]:
    """A few steps of the full call order; returns the losses it produced."""
    produced = []
    optimizer = torch.optim.SGD(method.parameters(), lr=0.1) if list(method.parameters()) else None
    for index, values in enumerate(rows):
        result = method(as_losses(values))
        produced.append(float(result.loss.detach()))
        if optimizer is not None:
            optimizer.zero_grad()
            result.loss.backward()
            optimizer.step()
        if method.needs_losses_after_step:
            method.update(torch.tensor(values * 0.9, dtype=F64))
        if index % 2 == 1:
            method.end_epoch()
    return produced


@pytest.mark.parametrize("name", ["uw", "imtl_l", "dwa", "famo"])
def test_a_loss_based_state_dict_round_trip_resumes_identically(name: str) -> None:
    original = make_scalarization(name, num_tasks=3).double()
    advance_on_losses(original, LOSS_SEQUENCE[:3])
    original(as_losses(LOSS_SEQUENCE[3]))  # mid-epoch for DWA, an update pending for FAMO
    state = {key: value.clone() for key, value in original.state_dict().items()}
    restored = make_scalarization(name, num_tasks=3).double()
    restored.load_state_dict(state)
    for key, value in original.state_dict().items():
        assert torch.equal(restored.state_dict()[key], value), key
    if name == "famo":
        original.update(torch.tensor(LOSS_SEQUENCE[4], dtype=F64))
        restored.update(torch.tensor(LOSS_SEQUENCE[4], dtype=F64))
    assert advance_on_losses(original, LOSS_SEQUENCE) == advance_on_losses(restored, LOSS_SEQUENCE)
    with pytest.raises(RuntimeError, match="size mismatch"):
        make_scalarization(name, num_tasks=2).load_state_dict(state)


def advance_on_model(method: Scalarization, problem: Problem, steps: int) -> list[tuple]:
    optimizer = torch.optim.SGD(
        [*problem.trunk.parameters(), *problem.heads.parameters(), *method.parameters()], lr=0.05
    )
    produced = []
    for _ in range(steps):
        if isinstance(method, COSMOS):
            method.next_preference()
        result = method(problem.losses())
        optimizer.zero_grad()
        result.loss.backward()
        optimizer.step()
        produced.append((result.loss.detach().clone(), result.weights.clone()))
    return produced


@pytest.mark.parametrize("name", sorted(GRADIENT_BASED))
def test_a_gradient_based_state_dict_round_trip_resumes_identically(name: str) -> None:
    problem = Problem()
    original = GRADIENT_BASED[name](3, problem.shared)
    advance_on_model(original, problem, 3)
    state = {key: value.clone() for key, value in original.state_dict().items()}
    twin = copy.deepcopy(problem)  # the same model, as a checkpoint would restore it
    restored = GRADIENT_BASED[name](3, twin.shared)
    restored.load_state_dict(state)
    for key, value in original.state_dict().items():
        assert torch.equal(restored.state_dict()[key], value), key
    ours, theirs = advance_on_model(original, problem, 3), advance_on_model(restored, twin, 3)
    for (loss_a, weights_a), (loss_b, weights_b) in zip(ours, theirs, strict=True):
        assert torch.equal(loss_a, loss_b) and torch.equal(weights_a, weights_b)
    for mine, yours in zip(problem.shared, twin.shared, strict=True):
        assert torch.equal(mine, yours)
    with pytest.raises(RuntimeError, match="size mismatch"):
        GRADIENT_BASED[name](2, Problem(tasks=2).shared).load_state_dict(state)


def test_famo_logits_are_not_parameters_and_uw_log_variances_are() -> None:
    assert list(FAMO(2).parameters()) == []
    assert [tuple(p.shape) for p in UW(2).parameters()] == [(2,)]
    assert list(GLS().parameters()) == [] and list(STCH(mu=1.0).parameters()) == []


def test_shared_parameters_are_not_state_or_parameters() -> None:
    problem = Problem()
    for name, build in GRADIENT_BASED.items():
        method = build(3, problem.shared)
        keys = set(method.state_dict())
        assert not any(key.startswith("_shared") for key in keys), (name, keys)
        expected = [(3,)] if name == "imtl" else []
        assert [tuple(p.shape) for p in method.parameters()] == expected, name


# --- end to end -------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(LOSS_BASED))
def test_a_tiny_two_task_model_trains_with_each_loss_based_method(name: str) -> None:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(64, 4, generator=generator)
    targets = [inputs @ torch.randn(4, generator=generator), torch.tanh(inputs[:, 0]) * 3.0]
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(4, 16), nn.Tanh())
    heads = nn.ModuleList([nn.Linear(16, 1), nn.Linear(16, 1)])
    method = make_scalarization(name, num_tasks=2, **LOSS_BASED[name])
    parameters = [*trunk.parameters(), *heads.parameters(), *method.parameters()]
    optimizer = torch.optim.Adam(parameters, lr=0.02)

    def task_losses() -> torch.Tensor:
        features = trunk(inputs)
        return torch.stack(
            [
                ((head(features).squeeze(1) - y) ** 2).mean()
                for head, y in zip(heads, targets, strict=True)
            ]
        )

    history = []
    for step in range(50):
        losses = task_losses()
        result = method(losses)
        optimizer.zero_grad()
        result.loss.backward()
        optimizer.step()
        if method.needs_losses_after_step:
            with torch.no_grad():
                method.update(task_losses())
        if step % 10 == 9:
            method.end_epoch()
        assert torch.isfinite(result.loss) and torch.isfinite(result.weights).all()
        history.append(losses.detach())
    history = torch.stack(history)
    assert torch.isfinite(history).all()
    assert (history[-5:].mean(0) < 0.7 * history[:5].mean(0)).all(), history[[0, -1]]


@pytest.mark.parametrize("name", sorted(GRADIENT_BASED))
def test_a_tiny_two_task_model_trains_with_each_gradient_based_method(name: str) -> None:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(64, 4, generator=generator)
    targets = [inputs @ torch.randn(4, generator=generator), torch.tanh(inputs[:, 0]) * 3.0]
    torch.manual_seed(0)
    conditioned = name == "cosmos"  # COSMOS's model sees the preference with its input
    trunk = nn.Sequential(nn.Linear(4 + 2 * conditioned, 16), nn.Tanh())
    heads = nn.ModuleList([nn.Linear(16, 1), nn.Linear(16, 1)])
    builders = {
        "grad_norm": lambda: GradNorm(2, trunk[0].parameters()),
        "db_mtl": lambda: DBMTL(2, trunk.parameters()),
        "moco": lambda: MoCo(2, trunk.parameters()),
        "imtl": lambda: IMTL(2, trunk.parameters()),
        "cosmos": lambda: COSMOS(2, 1.0, seed=0),
    }
    method = builders[name]()
    parameters = [*trunk.parameters(), *heads.parameters(), *method.parameters()]
    optimizer = torch.optim.Adam(parameters, lr=0.02)
    history = []
    for _ in range(40):
        features_in = inputs
        if conditioned:
            features_in = torch.cat([inputs, method.next_preference().float().expand(64, 2)], 1)
        features = trunk(features_in)
        losses = torch.stack(
            [
                ((h(features).squeeze(1) - y) ** 2).mean()
                for h, y in zip(heads, targets, strict=True)
            ]
        )
        result = method(losses)
        optimizer.zero_grad()
        result.loss.backward()
        optimizer.step()
        assert torch.isfinite(result.loss) and torch.isfinite(result.weights).all()
        history.append(losses.detach())
    history = torch.stack(history)
    assert torch.isfinite(history).all()
    assert (history[-5:].mean(0) < 0.7 * history[:5].mean(0)).all(), history[[0, -1]]
