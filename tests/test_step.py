"""The core's multi-objective step: per-objective gradients, weights, ``.grad``, a report.

Every expected gradient is computed independently: one ``torch.autograd.grad`` per loss on
a plain copy of the model, combined by hand.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from mogradient import Amortizer, CombinableLoss, HarmonizedStep
from mogradient.amortize import AmortizedStep
from mogradient.combinable import RowValues
from mogradient.engines import RowGradientError
from mogradient.harmonizers import MGDA, FixedWeights

K = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, K)).double()


def _per_sample_loss(model: nn.Module, inputs: torch.Tensor, kl: bool) -> CombinableLoss:
    """Row-wise per-sample losses: sample b of objective k is (output[b, k] - k)^2, so the
    per-row engine applies; an optional extra term plays the KL penalty."""
    output = model(inputs)
    terms = (output - torch.arange(K, dtype=output.dtype)).pow(2).T  # (K terms, B)
    coefficients = torch.eye(K, dtype=terms.dtype).unsqueeze(2).expand(K, K, len(inputs))
    extra = 0.1 * output.pow(2).mean() if kl else None
    return CombinableLoss(terms, coefficients / len(inputs), extra, rows=RowValues(terms))


def _reference(
    model: nn.Module, inputs: torch.Tensor, kl: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(K x D stack, extra's gradient) by one autograd.grad per objective."""
    parameters = list(model.parameters())
    loss = _per_sample_loss(model, inputs, kl)
    rows = []
    for objective in loss.objective_losses():
        grads = torch.autograd.grad(objective, parameters, retain_graph=True)
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    extra = torch.zeros_like(rows[0])
    if loss.extra is not None:
        grads = torch.autograd.grad(loss.extra, parameters)
        extra = torch.cat([g.reshape(-1) for g in grads])
    return torch.stack(rows), extra


def _grad(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    eps = torch.finfo(dtype).eps
    return {"rtol": 1e3 * eps, "atol": 1e3 * eps}


@pytest.mark.parametrize("engine", ["auto", "batched"])
@pytest.mark.parametrize("kl", [False, True])
def test_a_solve_step_writes_the_harmonized_sum_plus_the_extra_term(engine: str, kl: bool) -> None:
    model = _model()
    inputs = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    stack, extra = _reference(_model(), inputs, kl)
    weights = MGDA()(stack).weights

    step = HarmonizedStep(
        list(model.parameters()),
        Amortizer(MGDA(), period=1, rho=0.0),
        module=model,
        engine=engine,
        compute_dtype=torch.float64,
    )

    def stream():
        yield 1.0, _per_sample_loss(model, inputs, kl)  # drawn inside the engine: recorded

    report = step.solve(stream(), K, stream)
    expected = (weights.unsqueeze(1) * stack).sum(0) + extra
    torch.testing.assert_close(_grad(model), expected, **_tolerance(torch.float64))
    torch.testing.assert_close(report.weights, weights, **_tolerance(torch.float64))
    assert report.solved and report.engine == ("rows" if engine == "auto" else "batched")
    assert report.diagnostics["cos_min"] >= -1e-9  # MGDA's update conflicts with no objective
    assert report.backward_seconds >= 0 and report.harmonize_seconds >= 0


def test_a_cached_step_applies_the_cached_weights_with_one_combined_backward() -> None:
    model = _model()
    inputs = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    cached = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)

    def weigh(jacobian: torch.Tensor | None, count: int) -> AmortizedStep:
        assert jacobian is None and count == K
        return AmortizedStep(cached, solved=False)

    step = HarmonizedStep(list(model.parameters()), weigh, module=model)
    report = step.combine(
        [
            (0.5, _per_sample_loss(model, inputs, True)),
            (0.5, _per_sample_loss(model, inputs, True)),
        ],
        K,
    )
    stack, extra = _reference(_model(), inputs, True)
    expected = (cached.unsqueeze(1) * stack).sum(0) + extra
    torch.testing.assert_close(_grad(model), expected, **_tolerance(torch.float64))
    assert not report.solved and report.engine is None and report.diagnostics == {}


def test_separate_losses_give_each_loss_its_own_gradient() -> None:
    model = _model()
    inputs = torch.randn(7, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    weights = torch.tensor([1.0, 0.0, 2.0], dtype=torch.float64)
    step = HarmonizedStep(
        list(model.parameters()), Amortizer(FixedWeights(weights), period=1, rho=0.0)
    )
    losses = torch.stack(_per_sample_loss(model, inputs, False).objective_losses().unbind())
    step.solve([(1.0, CombinableLoss.separate(losses))], K)
    stack, _ = _reference(_model(), inputs, False)
    torch.testing.assert_close(
        _grad(model), (weights.unsqueeze(1) * stack).sum(0), **_tolerance(torch.float64)
    )
    with pytest.raises(ValueError, match=r"shape \(K,\)"):
        CombinableLoss.separate(losses.unsqueeze(0))


def test_the_per_row_engine_needs_a_replay() -> None:
    model = _model()
    inputs = torch.randn(3, 4, dtype=torch.float64)
    step = HarmonizedStep(list(model.parameters()), Amortizer(MGDA()), module=model)
    with pytest.raises(ValueError, match="pass replay"):
        step.solve([(1.0, _per_sample_loss(model, inputs, False))], K)


def test_a_refusing_engine_is_replaced_by_k_backward_passes_with_a_warning() -> None:
    model = _model()
    inputs = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    messages: list[str] = []
    step = HarmonizedStep(
        list(model.parameters()),
        Amortizer(MGDA(), period=1, rho=0.0),
        module=model,
        compute_dtype=torch.float64,
        warn=messages.append,
    )

    def refuse(losses, count, apply_extra=True):
        raise RowGradientError("rows interact (planted)")

    step.engine.stack = refuse  # the first call refuses; use_k_backward drops the rows engine
    original_use = step.engine.use_k_backward

    def use_k_backward() -> None:
        del step.engine.stack  # back to the class's K-backward path
        original_use()

    step.engine.use_k_backward = use_k_backward

    def stream():
        yield 1.0, _per_sample_loss(model, inputs, True)

    report = step.solve(stream(), K, stream)
    stack, extra = _reference(_model(), inputs, True)
    weights = MGDA()(stack).weights
    torch.testing.assert_close(
        _grad(model), (weights.unsqueeze(1) * stack).sum(0) + extra, **_tolerance(torch.float64)
    )
    assert report.engine == "batched"
    assert len(messages) == 1 and "refused this model (rows interact (planted))" in messages[0]


def test_a_disagreeing_engine_is_checked_once_and_its_stack_replaced() -> None:
    model = _model()
    inputs = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    step = HarmonizedStep(
        list(model.parameters()),
        Amortizer(MGDA(), period=1, rho=0.0),
        module=model,
        compute_dtype=torch.float64,
    )
    rows_stack = step.engine.rows.accumulate

    def wrong(losses, count, apply_extra=True):
        return rows_stack(losses, count=count, apply_extra=apply_extra) * 1.5  # planted error

    step.engine.rows.accumulate = wrong

    def stream():
        yield 1.0, _per_sample_loss(model, inputs, False)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = step.solve(stream(), K, stream)
    assert any("disagreed with K backward passes" in str(w.message) for w in caught)
    stack, _ = _reference(_model(), inputs, False)
    weights = MGDA()(stack).weights
    torch.testing.assert_close(
        _grad(model), (weights.unsqueeze(1) * stack).sum(0), **_tolerance(torch.float64)
    )
    assert report.engine == "batched" and step.engine.checked


def test_backward_follows_the_amortizers_schedule() -> None:
    """Period 3: a solve, two cached steps with the solve's weights, a solve again."""
    model = _model()
    inputs = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    step = HarmonizedStep(list(model.parameters()), Amortizer(MGDA(), period=3, rho=0.0))
    solved = []
    for _ in range(4):
        for parameter in model.parameters():
            parameter.grad = None
        losses = _per_sample_loss(model, inputs, False).objective_losses()
        report = step.backward(losses)
        solved.append(report.solved)
        if report.solved:
            first = report.weights
        stack, _ = _reference(model, inputs, False)
        expected = (report.weights.unsqueeze(1) * stack).sum(0)
        torch.testing.assert_close(_grad(model), expected, **_tolerance(torch.float64))
        torch.testing.assert_close(report.weights, first, **_tolerance(torch.float64))
    assert solved == [True, False, False, True]


def test_a_coordinatewise_harmonizer_writes_its_own_direction() -> None:
    """TrimmedMean's update is not a weighted sum of the gradients: the step applies the
    direction the harmonizer computed, and refuses cached steps (there is no cache)."""
    from mogradient.harmonizers import TrimmedMean

    model = _model()
    inputs = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    step = HarmonizedStep(list(model.parameters()), TrimmedMean(trim_number=1))
    losses = _per_sample_loss(model, inputs, False).objective_losses()
    step.solve(losses)
    stack, _ = _reference(_model(), inputs, False)
    expected = TrimmedMean(trim_number=1)(stack).direction
    torch.testing.assert_close(_grad(model), expected, **_tolerance(torch.float64))
    with pytest.raises(ValueError, match="keeps no weights between steps"):
        step.combine(_per_sample_loss(model, inputs, False).objective_losses())
