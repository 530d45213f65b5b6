"""No silent NaN or Inf out of the core: a finite answer where the exact one is
representable, else one clear error.

Inputs at the ends of a dtype's range: float32 rows near 3.4e38 (and float64 near 1.8e308),
whose partial sums overflow where the result does not; subnormal float64 rows (1e-310),
whose raw weights overflow; PBI's squares of losses near 1e20 (float32) or 1e160
(float64); a NaN loss or direction on its way into ``.grad``. References are exact: the
results below are sums of powers of two times the rows, or PBI's formula, homogeneous of
degree one, evaluated on unit losses.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from torch import nn

from mogradient import HARMONIZERS, SolverError, make_harmonizer
from mogradient._gram import CosineGram
from mogradient.engines import mtl_backward, write_gradient
from mogradient.harmonizers import FixedWeights, GradDrop, Harmonizer, TrimmedMean, WeighResult
from mogradient.scalarizations import PBI

DTYPES = (torch.float32, torch.float64)
OPTIONS = {"cr_mogm": {"inner": "mgda"}} | {
    name: {"seed": 0} for name in ("pcgrad", "rlw", "grad_vac", "grad_drop")
}


def near_max(dtype: torch.dtype, fraction: float = 0.9) -> float:
    return fraction * torch.finfo(dtype).max


def extreme_stacks(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Rows near the dtype's maximum, beside tiny ones, and subnormal ones."""
    generator = torch.Generator().manual_seed(0)
    gaussian = torch.randn(3, 8, generator=generator, dtype=torch.float64)
    big = torch.finfo(dtype).max
    tiny = 1e-310 if dtype == torch.float64 else 1e-40
    spread = torch.tensor(
        [[1e149], [1.0], [1e-298]] if dtype == torch.float64 else [[1e38], [1.0], [1e-44]],
        dtype=torch.float64,
    )
    return {
        "gaussian_near_max": (gaussian / gaussian.abs().max() * 0.9 * big).to(dtype),
        "identical_near_max": torch.full((3, 4), near_max(dtype), dtype=dtype),
        "near_dependent_near_max": (
            torch.stack([gaussian[0], gaussian[0] + 1e-9 * gaussian[1], gaussian[2]])
            / gaussian.abs().max()
            * 0.1
            * big
        ).to(dtype),
        "subnormal_beside_normal": torch.tensor(
            [[tiny, 2 * tiny, 0.0], [1.0, 2.0, 0.0], [0.0, 1.0, -1.0]], dtype=dtype
        ),
        "all_subnormal": torch.tensor(
            [[tiny, 2 * tiny, 0.0], [3 * tiny, -tiny, 0.1 * tiny], [0.0, tiny, -tiny]],
            dtype=dtype,
        ),
        # Norms spanning the dtype's range; in float64 beyond it (PCD failed in max()).
        "widest_spread": (gaussian / gaussian.abs().amax(1, keepdim=True) * spread).to(dtype),
    }


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(HARMONIZERS))
def test_every_method_is_finite_or_refuses_in_one_line(name: str, dtype: torch.dtype) -> None:
    """Before: PCGrad, GradVac, ConFIG, CAGrad and FixedWeights returned an Inf direction,
    TrimmedMean and GradDrop Inf or NaN weights, CAGrad a numpy LinAlgError."""
    for label, stack in extreme_stacks(dtype).items():
        harmonizer = make_harmonizer(name, **OPTIONS.get(name, {}))
        try:
            result = harmonizer(stack)
        except (OverflowError, SolverError) as error:
            assert "\n" not in str(error), (label, str(error))
            continue
        assert torch.isfinite(result.weights).all(), (label, result.weights)
        assert torch.isfinite(result.direction).all(), label


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_representable_sum_survives_overflowing_partial_sums(dtype: torch.dtype) -> None:
    """c + c - c = c for c near the maximum: the partial sum 2c overflowed to Inf."""
    stack = torch.full((3, 5), near_max(dtype), dtype=dtype)
    result = FixedWeights([1.0, 1.0, -1.0])(stack)
    assert torch.equal(result.direction, stack[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["fixed", "pcgrad", "grad_vac", "config", "grad_drop"])
def test_a_direction_beyond_the_dtype_is_refused(name: str, dtype: torch.dtype) -> None:
    """Three equal rows at 0.9 of the maximum: every method's exact direction is 3 rows
    (no conflict, equal angles, one sign), beyond the dtype. Before: Inf (GradDrop: NaN
    weights)."""
    stack = torch.full((3, 4), near_max(dtype), dtype=dtype)
    label = str(dtype).removeprefix("torch.")
    with pytest.raises(OverflowError, match=f"not representable in {label}"):
        make_harmonizer(name, **OPTIONS.get(name, {}))(stack)


def test_the_refused_message_gives_the_exact_size() -> None:
    stack = torch.full((3, 4), near_max(torch.float32), dtype=torch.float32)
    exact = 3 * float(stack[0, 0])
    message = re.escape(f"reach {exact:.3g}; float32 holds 3.4e+38")
    with pytest.raises(OverflowError, match=message):
        make_harmonizer("fixed")(stack)


class _RefinesToInf(Harmonizer):
    """Finite weights from weigh, an Inf one from refine."""

    def weigh(self, gram: CosineGram, objectives: torch.Tensor) -> WeighResult:
        return WeighResult(torch.ones(len(objectives), dtype=torch.float64))

    def refine(self, jacobian, objectives, gram, weighting) -> WeighResult:
        return WeighResult(torch.tensor([math.inf, 1.0], dtype=torch.float64))


def test_weights_are_checked_after_refine() -> None:
    with pytest.raises(SolverError, match=r"non-finite weights on objectives \[0\]"):
        _RefinesToInf()(torch.eye(2))


def least_squares_gap(stack: torch.Tensor, weights: torch.Tensor, direction: torch.Tensor) -> float:
    """||J^T w - d|| / ||d|| in float64, the residual the extras report."""
    rows, target = stack.double().numpy(), direction.double().numpy()
    return float(np.linalg.norm(rows.T @ weights.numpy() - target) / np.linalg.norm(target))


@pytest.mark.parametrize("harmonizer", [TrimmedMean(1), GradDrop(seed=0)], ids=["trim", "drop"])
def test_a_subnormal_row_gets_a_zero_stand_in_weight(harmonizer: Harmonizer) -> None:
    """Its least-squares weight is ~1e310 (its share of d over its norm): Inf before. It
    is left out of the fit, and the residual says what the weights miss."""
    stack = torch.tensor(
        [[1e-310, 2e-310, 0.0], [1.0, 2.0, 0.0], [0.0, 1.0, -1.0]], dtype=torch.float64
    )
    result = harmonizer(stack)
    assert torch.isfinite(result.weights).all() and result.weights[0] == 0
    gap = least_squares_gap(stack, result.weights, result.direction)
    assert result.extras["weights_residual"] == pytest.approx(gap, rel=1e-12, abs=1e-15)


def test_trimmed_mean_of_rows_near_the_float64_maximum() -> None:
    """The mean of three values near 1.8e308 is one of them: their float64 sum was Inf."""
    stack = torch.full((3, 4), near_max(torch.float64), dtype=torch.float64)
    result = TrimmedMean(0)(stack)
    assert torch.equal(result.direction, stack[0])


def test_graddrop_sign_purity_near_the_float64_maximum() -> None:
    """Columns [c, -c, -c] with c = 0.45 of the maximum: purity (1 + sum / sum|.|) / 2 is
    1/3, so a coordinate keeps c where the draw is below 1/3, else -2c. The sum of |g|
    (1.35 max) overflowed and the purity became 1/2."""
    c, columns = near_max(torch.float64, 0.45), 64
    stack = torch.tensor([c, -c, -c], dtype=torch.float64)[:, None].repeat(1, columns)
    draws = torch.rand(columns, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    expected = torch.where(draws < 1 / 3, stack[0], -2 * stack[0])
    assert torch.equal(GradDrop(seed=3)(stack).direction, expected)


PBI_SCALES = {torch.float32: (1e20, 1e-30), torch.float64: (1e160, 1e-170)}


@pytest.mark.parametrize(
    ("dtype", "scale"), [(dtype, scale) for dtype in DTYPES for scale in PBI_SCALES[dtype]]
)
def test_pbi_at_losses_whose_squares_leave_the_dtype(dtype: torch.dtype, scale: float) -> None:
    """Losses s [1, 3, 2]: d1 = 6 s / sqrt(3), d2 = sqrt(2) s, weights independent of s.
    Before: d2 = Inf (squares overflow) or 0 (squares underflow), so the loss was Inf, or
    lost its penalty, and the weights the penalty's gradient."""
    losses = torch.tensor([1.0, 3.0, 2.0], dtype=torch.float64).mul(scale).to(dtype)
    result = PBI(theta=5.0)(losses.requires_grad_())
    along, off = 6 / math.sqrt(3), math.sqrt(2)
    tolerance = 16 * torch.finfo(dtype).eps
    assert float(result.extras["d1"]) == pytest.approx(along * scale, rel=tolerance)
    assert float(result.extras["d2"]) == pytest.approx(off * scale, rel=tolerance)
    assert float(result.loss) == pytest.approx((along + 5 * off) * scale, rel=tolerance)
    unit = torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64) / math.sqrt(3)
    expected = unit + 5 * (torch.tensor([1.0, 3.0, 2.0], dtype=torch.float64) - 2) / off
    torch.testing.assert_close(result.weights.double(), expected, rtol=tolerance, atol=tolerance)


def test_pbi_beyond_float32_is_refused() -> None:
    losses = torch.tensor([3e38, 1e38, 0.0], requires_grad=True)
    with pytest.raises(OverflowError, match="beyond float32's range"):
        PBI()(losses)


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(3, 4)
        self.heads = nn.ModuleList([nn.Linear(4, 1), nn.Linear(4, 1)])

    def parameters_with_grad(self) -> list[str]:
        return [name for name, parameter in self.named_parameters() if parameter.grad is not None]


def test_mtl_backward_refuses_a_nan_loss_before_writing() -> None:
    """Before: head 1 got NaN gradients (the trunk dropped objective 1)."""
    model = _TwoHeads()
    features = torch.tanh(model.trunk(torch.randn(5, 3)))
    losses = [model.heads[0](features).mean(), model.heads[1](features).mean() * math.nan]
    with pytest.raises(ValueError, match="loss 1 is nan"):
        mtl_backward(losses, features, make_harmonizer("mgda"))
    assert model.parameters_with_grad() == []


def test_mtl_backward_refuses_a_nan_head_gradient_of_a_finite_loss() -> None:
    """sqrt at 0: the loss is 0, its gradient 0 * Inf = NaN."""
    model = _TwoHeads()
    features = torch.tanh(model.trunk(torch.randn(5, 3)))
    losses = [model.heads[0](features).mean(), torch.sqrt(model.heads[1](features).sum() * 0)]
    with pytest.raises(ValueError, match="parameter 0 of head 1"):
        mtl_backward(losses, features, make_harmonizer("mgda"))
    assert model.parameters_with_grad() == []


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_write_gradient_refuses_a_non_finite_direction(bad: float) -> None:
    model = nn.Linear(2, 2)
    for parameter in model.parameters():
        parameter.grad = torch.ones_like(parameter)
    direction = torch.zeros(6)
    direction[4] = bad
    with pytest.raises(ValueError, match="index 4, in parameter 1"):
        write_gradient(model.parameters(), direction, accumulate=True)
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in model.parameters())
