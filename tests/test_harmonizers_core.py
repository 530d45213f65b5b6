"""MGDA, PCGrad, weightings, dropout and EMA: published values, properties, bad input."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from mogradient import (
    HARMONIZERS,
    MGDA,
    FixedWeights,
    Mean,
    PCGrad,
    RandomWeights,
    RewardDropout,
    WeightEMA,
    conflict_diagnostics,
    make_harmonizer,
)
from mogradient._qp import solve_simplex_qp

TORCHJD_EXAMPLE = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]], dtype=torch.float64)

finite_floats = st.floats(-10, 10, allow_nan=False, allow_infinity=False, width=64)


@st.composite
def jacobians(draw: st.DrawFn, min_objectives: int = 2, max_objectives: int = 6) -> torch.Tensor:
    count = draw(st.integers(min_objectives, max_objectives))
    dim = draw(st.integers(1, 8))
    values = draw(arrays(np.float64, (count, dim), elements=finite_floats))
    jacobian = torch.from_numpy(values)
    # Keep every row usable: the drop logic is tested separately.
    return jacobian[jacobian.norm(dim=1) > 1e-3] if len(jacobian) else jacobian


def test_plain_mgda_matches_published_direction() -> None:
    result = MGDA(normalize=False)(TORCHJD_EXAMPLE)
    torch.testing.assert_close(
        result.direction, torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64), atol=1e-12, rtol=0
    )
    assert result.kkt_residual < 1e-12


def test_normalize_rescale_formula() -> None:
    norms = TORCHJD_EXAMPLE.norm(dim=1)
    units = TORCHJD_EXAMPLE / norms[:, None]
    alpha = torch.from_numpy(solve_simplex_qp((units @ units.T).numpy(), "cvxpy").weights)
    expected = norms.mean() * (alpha @ units)
    torch.testing.assert_close(MGDA()(TORCHJD_EXAMPLE).direction, expected, atol=1e-7, rtol=1e-7)


@given(jacobians())
def test_mgda_direction_never_conflicts(jacobian: torch.Tensor) -> None:
    if len(jacobian) < 2:
        return
    result = MGDA()(jacobian)
    units = jacobian / jacobian.norm(dim=1, keepdim=True)
    direction = result.direction
    # Below round-off of the gradients' scale the direction is zero (Pareto-stationary).
    if direction.norm() > 1e-10 * jacobian.norm(dim=1).max():
        assert (units @ direction / direction.norm()).min() >= -1e-6


# Found by `make fuzz`: two nearly parallel gradients (cosine 1 - 1e-15) have full
# numerical rank, but their simplex weights are not determined by any float64 Gram.
NEAR_PARALLEL = torch.tensor(
    [[-1.0, 5.9605e-08, 5.9605e-08], [-5.0, 5.9605e-08, 5.9605e-08]], dtype=torch.float64
)


# Found by `make fuzz`: an opposed pair plus a near-parallel one in 2-D (0 is in the hull).
OPPOSED_AND_NEAR_PARALLEL = torch.tensor(
    [[0.0, -8.0], [-9.75, 0.0], [-5.9605e-08, 1.5], [0.0, 1.0]], dtype=torch.float64
)


@given(jacobians(), st.randoms(use_true_random=False))
@example(NEAR_PARALLEL, random.Random(0))
@example(OPPOSED_AND_NEAR_PARALLEL, random.Random(1))
def test_mgda_permutation_permutes_weights(jacobian: torch.Tensor, rng: random.Random) -> None:
    if len(jacobian) < 2:
        return
    order = list(range(len(jacobian)))
    rng.shuffle(order)
    base, permuted = MGDA()(jacobian), MGDA()(jacobian[order])
    # The direction is unique, but a solve exact to round-off r in ||d||^2 pins it down
    # only to ~sqrt(r) ||g||: near-parallel gradients (cos 1 - 1e-15) reach 1e-7 ||g||.
    scale = float(jacobian.norm(dim=1).max())
    torch.testing.assert_close(permuted.direction, base.direction, atol=1e-6 * scale, rtol=1e-6)
    # Weights are unique only when the unit gradients are well conditioned: a singular
    # value s of the unit stack lets the Gram's round-off move them by ~eps / s^2.
    singular = torch.linalg.svdvals(jacobian / jacobian.norm(dim=1, keepdim=True))
    if len(jacobian) <= jacobian.shape[1] and singular.min() > 1e-3 * singular.max():
        torch.testing.assert_close(permuted.weights, base.weights[order], atol=1e-6, rtol=1e-5)


# Found by `make fuzz`: cos 1 - 8e-14, so d's small component is set by round-off.
NEAR_PARALLEL_PAIR = torch.tensor(
    [[0.0, 1.0], [1.17802264144743420365e-06, 3.0]], dtype=torch.float64
)


@given(jacobians(), st.floats(1e-3, 1e3))
@example(NEAR_PARALLEL_PAIR, 17.0)
def test_mgda_scaling(jacobian: torch.Tensor, factor: float) -> None:
    if len(jacobian) < 2:
        return
    # Round-off r in ||d||^2 pins d down to ~sqrt(r) ||g|| (near-parallel gradients).
    floor = 1e-6 * float(jacobian.norm(dim=1).max())
    # Normalize-rescale: direction is homogeneous of degree one in the gradients.
    torch.testing.assert_close(
        MGDA()(factor * jacobian).direction,
        factor * MGDA()(jacobian).direction,
        rtol=1e-6,
        atol=floor * factor,
    )
    # ...and rescaling single objectives only changes the rescale factor m.
    scales = torch.linspace(0.5, 3.0, len(jacobian), dtype=torch.float64)
    scaled = MGDA()(scales[:, None] * jacobian)
    base = MGDA()(jacobian)
    norms = jacobian.norm(dim=1)
    ratio = (scales * norms).mean() / norms.mean()
    torch.testing.assert_close(
        scaled.direction, ratio * base.direction, rtol=1e-5, atol=floor * float(ratio)
    )


def test_mgda_preferences_and_floor() -> None:
    jacobian = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    floored = MGDA(alpha_floor=0.2)(jacobian)
    assert min(floored.extras["alpha"]) >= 0.2 - 1e-12
    tilted = MGDA(preferences=[1.0, 3.0, 1.0])(jacobian)
    plain = MGDA()(jacobian)
    assert tilted.extras["alpha"][1] > plain.extras["alpha"][1]
    with pytest.raises(ValueError, match="infeasible"):
        MGDA(alpha_floor=0.5)(jacobian)
    with pytest.raises(ValueError, match="non-negative"):
        MGDA(preferences=[-1.0, 1.0])
    with pytest.raises(ValueError, match="finite"):
        MGDA(preferences=[float("nan"), 1.0])
    with pytest.raises(ValueError, match="alpha_floor"):
        MGDA(alpha_floor=-0.1)


def test_pcgrad_matches_explicit_projection() -> None:
    """PCGrad on two conflicting gradients projects each onto the other's normal plane."""
    first, second = (
        torch.tensor([1.0, 0.0], dtype=torch.float64),
        torch.tensor([-1.0, 1.0], dtype=torch.float64),
    )
    expected = (first - (first @ second) / (second @ second) * second) + (
        second - (second @ first) / (first @ first) * first
    )
    result = PCGrad(seed=0)(torch.stack([first, second]))
    torch.testing.assert_close(result.direction, expected)


def test_pcgrad_leaves_agreeing_gradients_alone() -> None:
    jacobian = torch.tensor([[1.0, 0.2], [0.5, 1.0], [0.3, 0.3]], dtype=torch.float64)
    torch.testing.assert_close(PCGrad(seed=1)(jacobian).weights, torch.ones(3, dtype=torch.float64))
    torch.testing.assert_close(
        PCGrad(reduction="mean", seed=1)(jacobian).weights,
        torch.full((3,), 1 / 3, dtype=torch.float64),
    )


def test_fixed_weights_and_mean() -> None:
    jacobian = torch.randn(3, 5, dtype=torch.float64)
    torch.testing.assert_close(
        FixedWeights([0.5, 0.3, 0.2])(jacobian).direction,
        torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64) @ jacobian,
    )
    torch.testing.assert_close(Mean()(jacobian).direction, jacobian.mean(dim=0))
    jacobian[1] = 0
    rescaled = FixedWeights([0.5, 0.3, 0.2])(jacobian)
    torch.testing.assert_close(
        rescaled.weights, torch.tensor([5 / 7, 0.0, 2 / 7], dtype=torch.float64)
    )
    with pytest.raises(ValueError, match="one weight per objective"):
        FixedWeights([1.0, 1.0])(torch.randn(3, 4))
    signed = torch.randn(3, 4, dtype=torch.float64)
    signed[2] = 0
    # The L1 mass 3.999 is kept: [1, 1] * 3.999 / 2, not a collapse by the signed sum.
    torch.testing.assert_close(
        FixedWeights([1.0, 1.0, -1.999])(signed).weights,
        torch.tensor([1.9995, 1.9995, 0.0], dtype=torch.float64),
    )


def test_random_weights_are_seeded_softmax() -> None:
    jacobian = torch.randn(4, 3)
    first, second = RandomWeights(seed=3)(jacobian), RandomWeights(seed=3)(jacobian)
    torch.testing.assert_close(first.weights, second.weights)
    assert math.isclose(float(first.weights.sum()), 1.0) and (first.weights > 0).all()


def test_reward_dropout_rate_warmup_and_renormalization() -> None:
    jacobian = torch.randn(4, 6, dtype=torch.float64)
    dropout = RewardDropout(
        FixedWeights([1.0, 1.0, 1.0, 1.0]), probability=0.5, seed=0, droppable=[1, 2, 3]
    )
    drops = torch.zeros(4)
    for _ in range(2000):
        result = dropout(jacobian)
        for index in result.dropped:
            drops[index] += 1
        assert math.isclose(float(result.weights.sum()), 4.0)
    assert drops[0] == 0
    assert torch.allclose(drops[1:] / 2000, torch.full((3,), 0.5), atol=0.05)
    warm = RewardDropout(Mean(), probability=0.8, warmup_steps=10, seed=0)
    assert warm.current_probability() == 0.0
    for _ in range(5):
        warm(jacobian)
    assert math.isclose(warm.current_probability(), 0.4)
    always = RewardDropout(Mean(), probability=1.0, seed=0)
    assert (always(jacobian).weights > 0).sum() == 1


def test_weight_ema() -> None:
    ema = WeightEMA(rho=0.7)
    first = ema.update(torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(first, torch.tensor([1.0, 0.0], dtype=torch.float64))
    second = ema.update(torch.tensor([0.0, 1.0]))
    torch.testing.assert_close(second, torch.tensor([0.7, 0.3], dtype=torch.float64))
    # Signed weights are blended, never rescaled by a near-zero or negative sum.
    signed = WeightEMA(rho=0.5)
    signed.update(torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(
        signed.update(torch.tensor([-0.99, 1.0])), torch.tensor([0.005, 0.5], dtype=torch.float64)
    )
    restored = WeightEMA()
    restored.load_state_dict(ema.state_dict())
    torch.testing.assert_close(restored.value, ema.value)
    with pytest.raises(ValueError, match="rho"):
        WeightEMA(rho=1.0)


@pytest.mark.parametrize("name", ["mgda", "pcgrad", "mean", "rlw"])
def test_bad_gradients_never_give_nan(name: str) -> None:
    harmonizer = make_harmonizer(name)
    jacobian = torch.randn(4, 5)
    jacobian[1, 2] = float("nan")
    jacobian[2] = float("inf")
    jacobian[3] = 0.0
    result = harmonizer(jacobian)
    assert torch.isfinite(result.direction).all() and torch.isfinite(result.weights).all()
    assert result.dropped == (1, 2, 3)
    assert result.fallback == "single_objective"
    zeros = harmonizer(torch.zeros(3, 5))
    assert zeros.fallback == "no_usable_objective"
    assert (zeros.direction == 0).all() and (zeros.weights == 0).all()


def test_single_objective_and_duplicates() -> None:
    gradient = torch.randn(1, 7, dtype=torch.float64)
    torch.testing.assert_close(MGDA()(gradient).direction, gradient[0])
    duplicated = torch.cat([gradient, gradient, -0.5 * gradient])
    result = MGDA()(duplicated)
    assert torch.isfinite(result.weights).all() and result.kkt_residual < 1e-12


def test_bad_shapes_are_named() -> None:
    with pytest.raises(ValueError, match="shape"):
        MGDA()(torch.zeros(5))
    with pytest.raises(ValueError, match="empty"):
        MGDA()(torch.zeros(0, 3))
    with pytest.raises(ValueError, match="exactly one"):
        MGDA()()
    with pytest.raises(ValueError, match="unknown harmonizer"):
        make_harmonizer("nope")


@pytest.mark.parametrize("name", sorted(HARMONIZERS))
def test_gram_only_input_gives_the_same_weights(name: str) -> None:
    jacobian = torch.randn(5, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    options = {"seed": 0} if name in ("pcgrad", "rlw", "gradvac", "graddrop") else {}
    if HARMONIZERS[name].needs_stack:
        with pytest.raises(ValueError, match="stack"):
            make_harmonizer(name, **options)(gram=jacobian @ jacobian.T)
        return
    from_gram = make_harmonizer(name, **options)(gram=jacobian @ jacobian.T)
    assert from_gram.direction is None
    torch.testing.assert_close(
        from_gram.weights, make_harmonizer(name, **options)(jacobian).weights
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_stacks_are_measured_in_float32(dtype: torch.dtype) -> None:
    # Entries of size ~30: float16 block sums of squares would overflow (max 65504).
    reference = 30 * torch.randn(3, 20_000, generator=torch.Generator().manual_seed(0))
    half = reference.to(dtype)
    result = MGDA()(half)
    assert result.dropped == () and result.fallback is None
    expected = MGDA()(half.double())
    torch.testing.assert_close(result.weights, expected.weights, rtol=1e-4, atol=1e-6)
    record = conflict_diagnostics(result.weights, jacobian=half)
    exact = conflict_diagnostics(result.weights, jacobian=half.double())
    for k in range(3):
        assert abs(record[f"cos/{k}"] - exact[f"cos/{k}"]) < 1e-2
