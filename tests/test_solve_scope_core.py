"""A solve that sees part of the step, or the output space: the core's pieces.

Expected values are computed independently: output-space gradients by central finite
differences on the loss as a function of the output; the solve's weights by cvxpy's
min-norm point on the unit gradients (MGDA normalize-and-rescale written out); the
applied gradient by one ``torch.autograd.grad`` per objective on a plain copy of the model.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from torch import nn

from mogradient import Amortizer, CombinableLoss, HarmonizedStep
from mogradient.combinable import RowValues
from mogradient.engines import gram_factor, output_cosines, output_gram, output_stack
from mogradient.harmonizers import MGDA

cvxpy = pytest.importorskip("cvxpy")

K = 3
DTYPES = [torch.float32, torch.float64]


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).to(dtype)


def _loss(output: torch.Tensor, coefficients: torch.Tensor) -> CombinableLoss:
    """Two per-sample terms of a 2-wide output (NFT's two branches, in miniature)."""
    terms = torch.stack(((output[:, 0] - 1).pow(2), (output[:, 1] + output[:, 0]).pow(2)))
    return CombinableLoss(
        terms, coefficients.to(output.dtype), rows=RowValues(terms), outputs=output
    )


def _coefficients(batch: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(K, 2, batch, generator=generator, dtype=torch.float64) / batch


def _stream(
    model: nn.Module, count: int, dtype: torch.dtype
) -> Iterator[tuple[float, CombinableLoss]]:
    """Pieces computed as drawn (a per-row engine records their forward)."""
    generator = torch.Generator().manual_seed(7)
    for index in range(count):
        inputs = torch.randn(3, 4, generator=generator).to(dtype)
        yield 0.5, _loss(model(inputs), _coefficients(3, index))


def _pieces(model: nn.Module, count: int, dtype: torch.dtype) -> list[tuple[float, CombinableLoss]]:
    return list(_stream(model, count, dtype))


def _tolerance(dtype: torch.dtype) -> float:
    return 1e3 * torch.finfo(dtype).eps


def _min_norm_weights(stack: np.ndarray) -> np.ndarray:
    """MGDA normalize-and-rescale by an independent solver: the min-norm point of the unit
    gradients (cvxpy), each alpha divided by its gradient's norm, times the mean norm."""
    norms = np.linalg.norm(stack, axis=1)
    units = stack / norms[:, None]
    alpha = cvxpy.Variable(len(stack))
    problem = cvxpy.Problem(
        cvxpy.Minimize(cvxpy.sum_squares(units.T @ alpha)), [alpha >= 0, cvxpy.sum(alpha) == 1]
    )
    problem.solve()
    return np.asarray(alpha.value) * norms.mean() / norms


@pytest.mark.parametrize("dtype", DTYPES)
def test_output_gradients_match_finite_differences(dtype: torch.dtype) -> None:
    output = torch.randn(3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    coefficients = _coefficients(3, 0)
    stack = output_stack(_loss(output.to(dtype).requires_grad_(), coefficients))
    step = 1e-6
    expected = torch.zeros(K, output.numel(), dtype=torch.float64)
    for index in range(output.numel()):
        shifted = [output.clone().reshape(-1) for _ in range(2)]
        shifted[0][index] += step
        shifted[1][index] -= step
        high, low = (_loss(s.reshape(3, 2), coefficients).objective_losses() for s in shifted)
        expected[:, index] = (high - low) / (2 * step)
    assert stack.shape == (K, output.numel())
    torch.testing.assert_close(stack, expected, rtol=1e-5 if dtype == torch.float64 else 1e-4,
                               atol=1e-7 if dtype == torch.float64 else 1e-5)  # fmt: skip


def test_a_loss_without_outputs_is_refused_in_one_line() -> None:
    terms = torch.ones(2, 3, requires_grad=True)
    with pytest.raises(ValueError, match="does not name its outputs"):
        output_stack(CombinableLoss(terms, torch.ones(K, 2, 3)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_step_gram_sums_the_pieces_scaled_grams(dtype: torch.dtype) -> None:
    pieces = _pieces(_model(dtype), 3, dtype)
    concatenated = torch.cat([scale * output_stack(loss) for scale, loss in pieces], dim=1)
    gram = output_gram(pieces, K)
    tolerance = _tolerance(dtype) * float(gram.abs().max())
    torch.testing.assert_close(gram, concatenated @ concatenated.T, rtol=0, atol=tolerance)


def test_the_gram_factor_keeps_norms_angles_and_exact_zero_rows() -> None:
    stack = torch.randn(4, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    stack[2] = 0.0  # an objective with no applicable sample in the solved micro-steps
    gram = stack @ stack.T
    factor = gram_factor(gram)
    torch.testing.assert_close(factor @ factor.T, gram, rtol=0, atol=1e-12 * float(gram.max()))
    assert factor[2].abs().max() == 0  # exactly: MGDA drops it instead of a huge weight
    weights = MGDA()(factor).weights
    assert weights[2] == 0 and torch.isfinite(weights).all()


def test_output_cosines_are_the_cosines_of_the_weighted_sum() -> None:
    stack = torch.randn(3, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    weights = torch.tensor([0.2, 0.5, 1.3], dtype=torch.float64)
    direction = weights @ stack
    expected = torch.nn.functional.cosine_similarity(stack, direction[None], dim=1)
    torch.testing.assert_close(output_cosines(stack @ stack.T, weights), expected)


def _reference_stack(dtype: torch.dtype, pieces: int) -> tuple[list, torch.Tensor]:
    """Per piece, the K x D parameter gradients of a fresh copy of the model (autograd)."""
    model = _model(dtype)
    parameters = list(model.parameters())
    rows = []
    for scale, loss in _pieces(model, pieces, dtype):
        per_objective = []
        for objective in loss.objective_losses():
            grads = torch.autograd.grad(objective, parameters, retain_graph=True)
            per_objective.append(scale * torch.cat([g.reshape(-1) for g in grads]))
        rows.append(torch.stack(per_objective))
    return parameters, torch.stack(rows)  # pieces x K x D


def _step(dtype: torch.dtype) -> tuple[nn.Module, HarmonizedStep]:
    model = _model(dtype)
    step = HarmonizedStep(
        list(model.parameters()),
        Amortizer(MGDA(), period=1, rho=0.0),
        module=model,
        compute_dtype=dtype,
    )
    return model, step


def _grad(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("solved", [1, 2])
def test_a_solve_on_the_first_pieces_applies_their_weights_to_the_whole_step(
    dtype: torch.dtype, solved: int
) -> None:
    _, per_piece = _reference_stack(dtype, 4)
    per_piece = per_piece.double()
    weights = torch.as_tensor(_min_norm_weights(per_piece[:solved].sum(0).numpy()))
    expected = weights @ per_piece.sum(0)

    model, step = _step(dtype)
    replay = lambda: _stream(model, 4, dtype)  # noqa: E731
    report = step.solve(_stream(model, 4, dtype), K, replay, pieces=solved)

    assert report.solved
    scale = float(expected.abs().max())
    solver = 1e-5  # cvxpy's default accuracy on the weights
    atol = (solver + _tolerance(dtype)) * scale * K
    torch.testing.assert_close(_grad(model), expected, rtol=0, atol=atol)
    torch.testing.assert_close(report.weights.double(), weights, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_output_space_solve_applies_the_output_gradients_weights(dtype: torch.dtype) -> None:
    model, step = _step(dtype)
    pieces = _pieces(model, 3, dtype)
    outputs = torch.cat([scale * output_stack(loss) for scale, loss in pieces], dim=1)
    weights = torch.as_tensor(_min_norm_weights(outputs.detach().double().numpy()))
    _, per_piece = _reference_stack(dtype, 3)
    expected = weights @ per_piece.double().sum(0)

    report = step.solve_outputs(pieces, K)

    assert report.engine == "outputs"
    torch.testing.assert_close(report.weights.double(), weights, rtol=1e-3, atol=1e-4)
    atol = (1e-5 + _tolerance(dtype)) * float(expected.abs().max()) * K
    torch.testing.assert_close(_grad(model), expected, rtol=0, atol=atol)
    # MGDA's weights make every objective's output-space cosine >= 0 (min-norm point)
    assert report.diagnostics["output_cos_min"] >= -math.sqrt(_tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_combined_step_can_measure_its_weights_in_output_space(dtype: torch.dtype) -> None:
    model = _model(dtype)
    weights = torch.tensor([1.0, -2.0, 0.5])  # cached weights that oppose objective 1
    step = HarmonizedStep(list(model.parameters()), lambda jacobian, count: _cached(weights))
    pieces = _pieces(model, 3, dtype)
    outputs = torch.cat([scale * output_stack(loss) for scale, loss in pieces], dim=1).double()
    direction = weights.double() @ outputs
    expected = torch.nn.functional.cosine_similarity(outputs, direction[None], dim=1).min()

    report = step.combine(pieces, K, measure_outputs=True)

    assert not report.solved
    assert math.isclose(report.diagnostics["output_cos_min"], float(expected), abs_tol=1e-5)
    _, per_piece = _reference_stack(dtype, 3)
    expected_grad = weights.double() @ per_piece.double().sum(0)
    atol = _tolerance(dtype) * float(expected_grad.abs().max()) * K
    torch.testing.assert_close(_grad(model), expected_grad, rtol=0, atol=atol)


def _cached(weights: torch.Tensor):
    from mogradient.amortize import AmortizedStep

    return AmortizedStep(weights, solved=False)


def test_a_partial_solve_refuses_nonsense_piece_counts() -> None:
    model, step = _step(torch.float64)
    with pytest.raises(ValueError, match="pieces must be >= 1"):
        step.solve(_pieces(model, 2, torch.float64), K, lambda: [], pieces=0)
