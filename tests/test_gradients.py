"""Per-objective gradient engines agree with independent per-loss backward passes."""

from __future__ import annotations

import pytest
import torch
from tolerances import reduction_atol
from torch import nn

from mogradient import CombinableLoss
from mogradient.engines import (
    accumulate_gradients,
    combinable_gradients,
    flat_gradient,
    objective_gradients,
    select_parameters,
    write_gradient,
)
from mogradient.errors import UnusedParameterError


def _model_and_losses() -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 12), nn.ReLU(), nn.Linear(12, 4))
    output = model(torch.randn(16, 5))
    return model, [output[:, k].pow(2).mean() for k in range(4)]


def _engine_atol(model: nn.Module) -> float:
    """Rounding bound for engines that order the gradient's sums differently.

    Each gradient entry sums per-sample terms over 16 samples, each itself a sum over at
    most 4 outputs: a reduction of 64 terms, bounded by the largest sum of |terms|.
    """
    torch.manual_seed(0)
    nn.Sequential(nn.Linear(5, 12), nn.ReLU(), nn.Linear(12, 4))  # same draws as above
    inputs = torch.randn(16, 5)
    parameters = {name: p.detach() for name, p in model.named_parameters()}

    def sample_losses(params: dict, x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, params, (x[None],))[0].pow(2) / len(inputs)

    terms = torch.func.vmap(torch.func.jacrev(sample_losses), in_dims=(None, 0))
    abs_sum = max(float(t.abs().sum(0).max()) for t in terms(parameters, inputs).values())
    return reduction_atol(torch.float32, 16 * 4, abs_sum)


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
    torch.testing.assert_close(stack, reference, rtol=0, atol=_engine_atol(model))


def test_combinable_engines_agree() -> None:
    torch.manual_seed(1)
    model = nn.Linear(3, 2)
    inputs = torch.randn(7, 3)
    terms = model(inputs).T.pow(2)
    coefficients = torch.rand(4, 2, 7)
    loss = CombinableLoss(terms, coefficients)
    batched = combinable_gradients(
        loss, model.parameters(), method="batched", retain_graph=True, chunk_size=3
    )
    sequential = combinable_gradients(loss, model.parameters(), method="sequential")
    # Both sum coefficient x term-gradient over the 2 x 7 (term, sample) pairs.
    per_term = torch.autograd.functional.jacobian(
        lambda w, b: (inputs @ w.T + b).T.pow(2), (model.weight.detach(), model.bias.detach())
    )
    abs_sum = max(
        float(torch.einsum("kjb,jb...->k...", coefficients, g.abs()).max()) for g in per_term
    )
    atol = reduction_atol(torch.float32, 2 * 7, abs_sum)
    torch.testing.assert_close(batched, sequential, rtol=0, atol=atol)


def _two_heads() -> tuple[nn.ModuleDict, torch.Tensor]:
    """Two heads on one input: loss 0 reads only head "a", loss 1 reads both."""
    torch.manual_seed(2)
    model = nn.ModuleDict({"a": nn.Linear(2, 1), "b": nn.Linear(2, 1), "spare": nn.Linear(2, 1)})
    x = torch.randn(4, 2)
    a, b = model["a"](x).sum(), model["b"](x).sum()
    return model, torch.stack([a, a + b])


ENGINES = [("sequential", None), ("batched", None), ("batched", 1)]


@pytest.mark.parametrize(("method", "chunk"), ENGINES)
def test_a_parameter_one_objective_does_not_touch_gets_zeros_in_its_row(method, chunk) -> None:
    model, losses = _two_heads()
    parameters = [*model["a"].parameters(), *model["b"].parameters()]
    stack = objective_gradients(losses, parameters, method=method, chunk_size=chunk)
    assert stack.shape == (2, 6)
    assert (stack[0, 3:] == 0).all() and (stack[1, 3:] != 0).any()
    torch.testing.assert_close(stack[0, :3], stack[1, :3], rtol=0, atol=0)


@pytest.mark.parametrize(("method", "chunk"), ENGINES)
def test_a_parameter_no_objective_touches_is_an_error_naming_it(method, chunk) -> None:
    model, losses = _two_heads()
    with pytest.raises(
        UnusedParameterError, match=r"parameter 4 'spare.weight' \(shape \(1, 2\)\)"
    ):
        objective_gradients(losses, model.named_parameters(), method=method, chunk_size=chunk)
    model, losses = _two_heads()
    with pytest.raises(
        ValueError, match=r"2 of 6 parameters .* parameter 4 \(shape \(1, 2\)\).*select_parameters"
    ):
        objective_gradients(losses, model.parameters(), method=method, chunk_size=chunk)


@pytest.mark.parametrize("method", ["sequential", "batched"])
def test_combinable_gradients_keep_genuine_zeros_and_reject_unused_parameters(method) -> None:
    torch.manual_seed(3)
    model = nn.ModuleDict({"a": nn.Linear(3, 1), "b": nn.Linear(3, 1), "spare": nn.Linear(3, 1)})
    x = torch.randn(5, 3)
    terms = torch.cat([model["a"](x).T, model["b"](x).T])  # J = 2 terms x B = 5 samples
    coefficients = torch.rand(2, 2, 5)
    coefficients[0, 1] = 0  # objective 0 does not read head "b"
    loss = CombinableLoss(terms, coefficients)
    heads = [*model["a"].parameters(), *model["b"].parameters()]
    stack = combinable_gradients(loss, heads, method=method, retain_graph=True)
    assert (stack[0, 4:] == 0).all() and (stack[1, 4:] != 0).any()
    with pytest.raises(UnusedParameterError, match=r"'spare\.bias'"):
        combinable_gradients(loss, dict(model.named_parameters()), method=method)


def test_named_parameters_give_the_same_stack_as_plain_ones() -> None:
    model, losses = _model_and_losses()
    plain = objective_gradients(losses, model.parameters(), retain_graph=True)
    named = objective_gradients(losses, model.named_parameters())
    torch.testing.assert_close(named, plain, rtol=0, atol=0)


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
    with pytest.raises(ValueError, match="do not require grad: parameter 0"):
        objective_gradients([model(torch.ones(1, 2)).sum()], [torch.ones(2)])
    with pytest.raises(ValueError, match="not a mix"):
        objective_gradients(
            [model(torch.ones(1, 2)).sum()], [("w", model[0].weight), model[0].bias]
        )
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


def test_write_gradient_accumulates_onto_existing_and_missing_grads() -> None:
    model = nn.Linear(3, 2)
    model.weight.grad = torch.ones_like(model.weight)  # the bias has no .grad yet
    direction = torch.arange(8, dtype=torch.float32)
    write_gradient(model.parameters(), direction, accumulate=True)
    torch.testing.assert_close(model.weight.grad.reshape(-1), direction[:6] + 1, rtol=0, atol=0)
    torch.testing.assert_close(model.bias.grad, direction[6:], rtol=0, atol=0)


def _pieces(model: nn.Module) -> list[tuple[float, CombinableLoss]]:
    """Two (scale, CombinableLoss) pieces of a float64 model: K = 3 signed objectives on
    two shared terms, and a KL-like extra term."""
    torch.manual_seed(3)
    pieces = []
    for scale, rows in ((0.25, 5), (0.75, 3)):
        output = model(torch.randn(rows, 4, dtype=torch.float64))
        terms = torch.stack((output[:, 0].pow(2), torch.tanh(output[:, 1])))
        coefficients = torch.randn(3, 2, rows, dtype=torch.float64)
        pieces.append((scale, CombinableLoss(terms, coefficients, 0.3 * output.pow(2).mean())))
    return pieces


def _written_out(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sum scale * C[k, j, b] * grad T[j, b] from one gradient per term, the extra's
    gradient, and the sums of absolute values of those products (for the rounding bound)."""
    parameters = list(model.parameters())
    rows, magnitudes, extra = 0, 0, 0
    for scale, loss in _pieces(model):
        per_term = torch.stack(
            [
                torch.cat(
                    [
                        g.reshape(-1)
                        for g in torch.autograd.grad(term, parameters, retain_graph=True)
                    ]
                )
                for term in loss.terms.reshape(-1)
            ]
        )  # [J * B, D]
        coefficients = loss.coefficients.reshape(3, -1)
        rows = rows + scale * coefficients @ per_term
        magnitudes = magnitudes + scale * coefficients.abs() @ per_term.abs()
        grads = torch.autograd.grad(loss.extra, parameters)
        extra = extra + scale * torch.cat([g.reshape(-1) for g in grads])
    return rows, extra, magnitudes


def test_accumulate_gradients_stack_and_weighted_paths_match_the_written_out_sums() -> None:
    torch.manual_seed(4)
    model = nn.Linear(4, 2).double()
    parameters = list(model.parameters())
    weights = torch.tensor([0.7, -1.3, 0.2], dtype=torch.float64)
    rows, extra, magnitudes = _written_out(model)
    # Each entry sums 16 (term, sample) products and the extra; the extra's own gradient
    # is one backward either way (equal up to its reduction over 8 x 2 outputs).
    extra_atol = reduction_atol(torch.float64, 16, float(extra.abs().max()))
    atol = reduction_atol(torch.float64, 16, float(magnitudes.max())) + extra_atol

    stack = accumulate_gradients(_pieces(model), parameters)
    torch.testing.assert_close(stack, rows, rtol=0, atol=atol)
    torch.testing.assert_close(flat_gradient(parameters), extra, rtol=0, atol=extra_atol)

    model.zero_grad(set_to_none=True)
    assert accumulate_gradients(_pieces(model), parameters, weights) is None
    weighted_atol = reduction_atol(torch.float64, 48, float((weights.abs() @ magnitudes).max()))
    torch.testing.assert_close(
        flat_gradient(parameters), weights @ rows + extra, rtol=0, atol=weighted_atol + extra_atol
    )

    model.zero_grad(set_to_none=True)
    accumulate_gradients(_pieces(model), parameters, apply_extra=False)
    assert all(p.grad is None for p in parameters)


def test_accumulate_gradients_of_an_empty_stream() -> None:
    model = nn.Linear(3, 2)
    stack = accumulate_gradients([], list(model.parameters()), count=4)
    assert torch.equal(stack, torch.zeros(4, 8))
    with pytest.raises(ValueError, match="needs count"):
        accumulate_gradients([], list(model.parameters()))


def test_flat_gradient_concatenates_grads_with_zeros_for_missing_ones():
    from mogradient.engines import flat_gradient

    a, b = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(3))
    a.grad = torch.arange(4.0).view(2, 2)
    torch.testing.assert_close(flat_gradient([a, b]), torch.tensor([0.0, 1, 2, 3, 0, 0, 0]))
