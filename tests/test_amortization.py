"""Amortized single backward == sum_k w_k g_k from separate per-objective backward passes.

The per-objective losses are written out independently (NaN-aware means of NFT-style
two-branch losses with clamped coefficients), not through CombinableLoss, so the test
checks the protocol against the quantity it claims to reproduce.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from mogradient import Amortizer, CombinableLoss, Harmonizer, masked_mean_coefficients
from mogradient.amortize import cancellation_ratio
from mogradient.engines import combinable_gradients, objective_gradients
from mogradient.errors import SolverError
from mogradient.harmonizers import MGDA, FixedWeights, Mean, NashMTL, RewardDropout, WeighResult

A_MAX = 1.0


def _network() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2)).double()


def _branches(network: nn.Module, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = network(inputs)
    return out[:, 0].pow(2), (out[:, 1] - 1).pow(2)


def _rewards(count: int, batch: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(count)
    advantages = 2.0 * torch.randn(count, batch, generator=generator, dtype=torch.float64)
    advantages[0, : batch // 2] = float("nan")  # objective 0 applies to half the batch
    advantages[-1, ::3] = float("nan")
    return advantages


def _direct_losses(positive, negative, advantages) -> list[torch.Tensor]:
    losses = []
    for row in advantages:
        valid = ~torch.isnan(row)
        ratio = torch.clamp(0.5 + row[valid] / (2 * A_MAX), 0.0, 1.0)
        losses.append((ratio * positive[valid] + (1 - ratio) * negative[valid]).mean())
    return losses


def _combinable(positive, negative, advantages) -> CombinableLoss:
    ratio = torch.clamp(0.5 + torch.nan_to_num(advantages) / (2 * A_MAX), 0.0, 1.0)
    per_sample = torch.stack([ratio, 1 - ratio], dim=1)
    coefficients = masked_mean_coefficients(per_sample, ~torch.isnan(advantages))
    return CombinableLoss(torch.stack([positive, negative]), coefficients)


@pytest.mark.parametrize("count", [3, 4, 5])
def test_amortized_backward_equals_weighted_per_objective_gradients(count: int) -> None:
    network, inputs = _network(), torch.randn(24, 6, dtype=torch.float64)
    advantages = _rewards(count, 24)
    ratio = 0.5 + advantages / (2 * A_MAX)
    assert ((ratio > 1) | (ratio < 0)).any(), "some coefficients must be clamped"
    parameters = list(network.parameters())
    reference = objective_gradients(
        _direct_losses(*_branches(network, inputs), advantages), parameters
    )
    weights = MGDA()(reference).weights
    weights[1] = -0.3  # any real weights, not only simplex ones
    loss = _combinable(*_branches(network, inputs), advantages)
    amortized = torch.autograd.grad(loss.combined(weights), parameters)
    amortized = torch.cat([grad.reshape(-1) for grad in amortized])
    expected = weights @ reference
    assert (amortized - expected).norm() <= 1e-6 * expected.norm()
    # The protocol's own per-objective gradients agree with the direct ones too.
    protocol = combinable_gradients(
        _combinable(*_branches(network, inputs), advantages), parameters
    )
    assert (protocol - reference).norm() <= 1e-10 * reference.norm()


def test_extra_term_is_added_once_with_its_own_weight() -> None:
    network, inputs = _network(), torch.randn(8, 6, dtype=torch.float64)
    positive, negative = _branches(network, inputs)
    kl = 1e-2 * network(inputs).pow(2).sum()
    advantages = _rewards(3, 8)
    base = _combinable(positive, negative, advantages)
    with_extra = CombinableLoss(base.terms, base.coefficients, extra=kl)
    weights = torch.tensor([0.2, 0.5, 0.3])
    torch.testing.assert_close(with_extra.combined(weights), base.combined(weights) + kl)


def test_coefficient_validation() -> None:
    terms = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="NaN or Inf"):
        CombinableLoss(terms, torch.full((3, 2, 4), float("nan")))
    with pytest.raises(ValueError, match="matching"):
        CombinableLoss(terms, torch.zeros(3, 2, 5))
    with pytest.raises(ValueError, match="need 3 weights"):
        CombinableLoss(terms, torch.zeros(3, 2, 4)).combined([1.0])


class _Failing(Harmonizer):
    def weigh(self, gram: torch.Tensor, objectives: torch.Tensor) -> WeighResult:
        raise SolverError("solver exploded")


def test_schedule_warmup_then_every_period() -> None:
    amortizer = Amortizer(MGDA(), period=3, warmup_steps=2, rho=0.5)
    jacobian = torch.randn(3, 10, dtype=torch.float64)
    pattern = []
    for _ in range(9):
        if amortizer.needs_full_solve():
            pattern.append("S")
            amortizer.full_step(jacobian)
        else:
            pattern.append("c")
            amortizer.cached_step()
    assert "".join(pattern) == "SSccSccSc"  # warm-up, then 1 solve + 2 cached


def test_cached_steps_reuse_smoothed_weights() -> None:
    amortizer = Amortizer(FixedWeights([1.0, 1.0]), period=2, rho=0.7)
    first = amortizer.full_step(gram=torch.eye(2))
    torch.testing.assert_close(first.weights, torch.tensor([1.0, 1.0], dtype=torch.float64))
    torch.testing.assert_close(amortizer.cached_step().weights, first.weights)
    amortizer.harmonizer = FixedWeights([2.0, 0.0])
    second = amortizer.full_step(gram=torch.eye(2))
    torch.testing.assert_close(second.weights, torch.tensor([2.0, 0.0], dtype=torch.float64))
    # 0.7 * [1, 1] + 0.3 * [2, 0] = [1.3, 0.7], rescaled to the new total 2: unchanged.
    cached = amortizer.cached_step().weights
    torch.testing.assert_close(cached, torch.tensor([1.3, 0.7], dtype=torch.float64))


def test_smoothing_never_revives_a_nan_gradient() -> None:
    amortizer = Amortizer(MGDA(), period=1, rho=0.7)
    jacobian = torch.randn(3, 10, dtype=torch.float64)
    amortizer.full_step(jacobian)
    jacobian[1] = float("nan")
    step = amortizer.full_step(jacobian)
    assert step.weights[1] == 0 and step.weights[[0, 2]].gt(0).all()
    from mogradient.harmonizers import combine

    assert torch.isfinite(combine(jacobian, step.weights)).all()


def test_harmonizer_state_survives_a_resume() -> None:
    def fresh() -> Amortizer:
        return Amortizer(RewardDropout(Mean(), 0.5, warmup_steps=4, seed=1), period=1)

    jacobian = torch.randn(4, 6, dtype=torch.float64)
    original = fresh()
    for _ in range(3):
        original.full_step(jacobian)
    restored = fresh()
    restored.load_state_dict(original.state_dict())
    for _ in range(5):
        torch.testing.assert_close(
            restored.full_step(jacobian).weights, original.full_step(jacobian).weights
        )


def test_fallbacks_are_explicit_and_keep_the_cache(caplog: pytest.LogCaptureFixture) -> None:
    amortizer = Amortizer(MGDA(), period=1)
    jacobian = torch.randn(3, 10, dtype=torch.float64)
    cached = amortizer.full_step(jacobian).weights
    with caplog.at_level(logging.WARNING, logger="mogradient.amortize"):
        zero = amortizer.full_step(torch.zeros(3, 10, dtype=torch.float64))
    assert zero.fallback == "no_usable_objective" and not zero.solved
    torch.testing.assert_close(zero.weights, cached)
    assert "no_usable_objective" in caplog.text
    single = torch.zeros(3, 10, dtype=torch.float64)
    single[1] = 1.0
    one = amortizer.full_step(single)
    assert one.fallback == "single_objective"
    torch.testing.assert_close(amortizer.cached_step().weights, cached)
    failing = Amortizer(_Failing(), period=1)
    failed = failing.full_step(jacobian)
    assert failed.fallback.startswith("solver_failure")
    assert failed.weights.shape == (3,) and (failed.weights == 0).all()
    # Configuration errors are not solver failures: they surface at once.
    with pytest.raises(ValueError, match="one weight per objective"):
        Amortizer(FixedWeights([1.0, 2.0])).full_step(jacobian)
    with pytest.raises(RuntimeError, match="first step"):
        Amortizer(MGDA()).cached_step()


def test_state_round_trip() -> None:
    amortizer = Amortizer(MGDA(), period=4)
    amortizer.full_step(torch.randn(3, 5, dtype=torch.float64))
    amortizer.cached_step()
    restored = Amortizer(MGDA(), period=4)
    restored.load_state_dict(amortizer.state_dict())
    assert restored.needs_full_solve() == amortizer.needs_full_solve()
    torch.testing.assert_close(restored.cached_step().weights, amortizer.cached_step().weights)


def test_solve_steps_apply_the_fresh_solution_and_cached_steps_the_smoothed_one() -> None:
    """MARBLE's published pseudocode: alpha* on the solve step, the EMA between solves.
    The fresh MGDA direction conflicts with no objective; the smoothed one may."""
    generator = torch.Generator().manual_seed(3)
    amortizer = Amortizer(MGDA(), period=2, rho=0.7)
    first = torch.randn(3, 20, generator=generator, dtype=torch.float64)
    amortizer.full_step(first)
    amortizer.cached_step()
    second = torch.randn(3, 20, generator=generator, dtype=torch.float64)
    step = amortizer.full_step(second)
    fresh = MGDA()(second)
    torch.testing.assert_close(step.weights, fresh.weights)
    assert (second @ fresh.direction).min() >= -1e-12 * second.norm(dim=1).max() ** 2
    smoothed = amortizer.cached_step().weights
    assert not torch.allclose(smoothed, fresh.weights)
    ablation = Amortizer(MGDA(), period=2, rho=0.7, smooth_solve_steps=True)
    ablation.full_step(first)
    ablation.cached_step()
    torch.testing.assert_close(ablation.full_step(second).weights, smoothed)


class _Cancelling(Harmonizer):
    """Weights of 1e6 in each gradient's units: on opposed gradients they cancel."""

    def weigh(self, gram, objectives: torch.Tensor) -> WeighResult:
        return WeighResult(1e6 / gram.norms * 2.0**-gram.exponent)


def test_cancellation_ratio_is_the_weights_share_of_the_direction_they_give() -> None:
    """Against the definition, computed from the stack itself."""
    generator = torch.Generator().manual_seed(0)
    for scale in (1e-30, 1.0, 1e30):
        jacobian = scale * torch.randn(4, 30, generator=generator, dtype=torch.float64)
        weights = torch.randn(4, generator=generator, dtype=torch.float64) / scale
        weights[2] = 0.0
        expected = (weights.abs() * jacobian.norm(dim=1)).sum() / (weights @ jacobian).norm()
        got = cancellation_ratio(weights, jacobian @ jacobian.T)
        assert got == pytest.approx(float(expected), rel=1e-10)
    aligned = torch.ones(2, 3, dtype=torch.float64)
    assert cancellation_ratio(torch.tensor([1.0, 2.0]), aligned @ aligned.T) == pytest.approx(1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cancelling_weights_are_never_cached(dtype, caplog: pytest.LogCaptureFixture) -> None:
    """Weights that cancel beyond the stack's precision would turn the next steps' updates
    into round-off: the solve is refused, the cache kept, the reason logged."""
    x = torch.tensor([1.0, 2.0, 2.0], dtype=dtype)
    opposed = torch.stack([x, -1.3 * x])
    amortizer = Amortizer(_Cancelling(), period=1)
    with caplog.at_level(logging.WARNING, logger="mogradient.amortize"):
        step = amortizer.full_step(opposed)
    assert not step.solved and step.fallback.startswith("cancelling_weights")
    assert "cancelling_weights" in caplog.text
    assert amortizer.ema.value is None and (step.weights == 0).all()
    # The same weights on gradients they do not cancel on are cached.
    spread = torch.eye(2, 3, dtype=dtype)
    assert amortizer.full_step(spread).solved and amortizer.ema.value is not None


def test_mgda_at_a_stationary_point_is_cached() -> None:
    """Its weights cancel (the direction is zero) but stay at the gradients' scale: caching
    them is MARBLE's behaviour, and re-applied they give an update of that scale."""
    x = torch.tensor([1.0, 2.0, 2.0], dtype=torch.float64)
    amortizer = Amortizer(MGDA(), period=1)
    step = amortizer.full_step(torch.stack([x, -1.3 * x]))
    assert step.solved and step.fallback is None
    assert amortizer.ema.value is not None


def test_nash_mtl_on_an_opposed_float32_pair_leaves_no_cache() -> None:
    """The peer suite's case: Nash-MTL's weights there are ~1e7 that cancel (or zero, at
    a Pareto-stationary point); either way nothing is cached."""
    x = torch.tensor([1.0, 2.0, 2.0])
    amortizer = Amortizer(NashMTL(), period=1)
    step = amortizer.full_step(torch.stack([x, -1.3 * x]))
    assert not step.solved and step.fallback is not None
    assert amortizer.ema.value is None


def test_boolean_options_refuse_strings() -> None:
    """'false' from a quoted YAML value must not switch the ablation on."""
    from mogradient.scalarizations import MoCo

    with pytest.raises(ValueError, match="smooth_solve_steps must be True or False"):
        Amortizer(MGDA(), smooth_solve_steps="false")
    with pytest.raises(ValueError, match="normalize must be True or False"):
        MoCo(2, [torch.zeros(3, requires_grad=True)], normalize="false")
