"""Per-objective gradient engines agree with independent per-loss backward passes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mogradient import (
    CombinableLoss,
    combinable_gradients,
    objective_gradients,
    select_parameters,
    write_gradient,
)


def _model_and_losses() -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 12), nn.ReLU(), nn.Linear(12, 4))
    output = model(torch.randn(16, 5))
    return model, [output[:, k].pow(2).mean() for k in range(4)]


def _separate_backward(model: nn.Module, losses: list[torch.Tensor]) -> torch.Tensor:
    rows = []
    for loss in losses:
        model.zero_grad()
        loss.backward(retain_graph=True)
        rows.append(torch.cat([p.grad.reshape(-1).clone() for p in model.parameters()]))
    return torch.stack(rows)


@pytest.mark.parametrize(
    ("method", "chunk"), [("sequential", None), ("batched", None), ("batched", 3)]
)
def test_engines_match_loss_backward(method: str, chunk: int | None) -> None:
    model, losses = _model_and_losses()
    reference = _separate_backward(model, losses)
    stack = objective_gradients(
        losses, model.parameters(), method=method, chunk_size=chunk, retain_graph=True
    )
    torch.testing.assert_close(stack, reference, rtol=1e-5, atol=1e-7)


def test_combinable_engines_agree() -> None:
    torch.manual_seed(1)
    model = nn.Linear(3, 2)
    output = model(torch.randn(7, 3))
    terms = output.T.pow(2)
    coefficients = torch.rand(4, 2, 7)
    loss = CombinableLoss(terms, coefficients)
    batched = combinable_gradients(
        loss, model.parameters(), method="batched", retain_graph=True, chunk_size=3
    )
    sequential = combinable_gradients(loss, model.parameters(), method="sequential")
    torch.testing.assert_close(batched, sequential, rtol=1e-5, atol=1e-7)


def test_unused_parameters_get_zero_rows() -> None:
    model = nn.ModuleDict({"used": nn.Linear(2, 1), "unused": nn.Linear(2, 1)})
    loss = model["used"](torch.ones(1, 2)).sum()
    stack = objective_gradients([loss], model.parameters())
    assert stack.shape == (1, 6) and (stack[0, 3:] == 0).all()


def test_parameter_filter_and_errors() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    selected = select_parameters(model, lambda name, _: name.startswith("1."))
    assert [p.shape for p in selected] == [torch.Size([1, 2]), torch.Size([1])]
    with pytest.raises(ValueError, match="no trainable parameters"):
        select_parameters(model, lambda name, _: "lora" in name)
    with pytest.raises(ValueError, match="parameter set is empty"):
        objective_gradients([torch.tensor(1.0, requires_grad=True)], [])
    with pytest.raises(ValueError, match="scalar"):
        objective_gradients([model(torch.ones(3, 2))], model.parameters())
    with pytest.raises(ValueError, match="unknown gradient method"):
        objective_gradients([model(torch.ones(1, 2)).sum()], model.parameters(), method="x")


def test_write_gradient_round_trip() -> None:
    model = nn.Linear(3, 2)
    direction = torch.arange(8, dtype=torch.float32)
    write_gradient(model.parameters(), direction)
    torch.testing.assert_close(
        torch.cat([p.grad.reshape(-1) for p in model.parameters()]), direction
    )
    with pytest.raises(ValueError, match="need"):
        write_gradient(model.parameters(), torch.zeros(3))


def test_flat_gradient_concatenates_grads_with_zeros_for_missing_ones():
    from mogradient import flat_gradient

    a, b = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(3))
    a.grad = torch.arange(4.0).view(2, 2)
    torch.testing.assert_close(flat_gradient([a, b]), torch.tensor([0.0, 1, 2, 3, 0, 0, 0]))
