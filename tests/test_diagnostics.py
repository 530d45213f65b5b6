"""Conflict diagnostics against cosines computed directly from the vectors."""

from __future__ import annotations

import math

import torch

from mogradient import ConflictAccumulator, conflict_diagnostics
from mogradient.harmonizers import MGDA, FixedWeights


def test_cosines_match_direct_computation() -> None:
    torch.manual_seed(0)
    jacobian = torch.randn(4, 9, dtype=torch.float64)
    weights = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    record = conflict_diagnostics(weights, jacobian=jacobian)
    direction = weights @ jacobian
    direct = torch.nn.functional.cosine_similarity(jacobian, direction[None, :], dim=1)
    for k in range(4):
        assert math.isclose(record[f"cos/{k}"], float(direct[k]), rel_tol=1e-10)
    assert math.isclose(record["cos_min"], float(direct.min()), rel_tol=1e-10)
    assert math.isclose(record["cos_var"], float(direct.var(unbiased=False)), rel_tol=1e-8)
    assert record["anti_aligned"] == int(direct.min() < 0)


def test_weighted_sum_conflicts_where_mgda_does_not() -> None:
    jacobian = torch.tensor([[10.0, 0.0], [-1.0, 1.0]], dtype=torch.float64)
    summed = conflict_diagnostics(FixedWeights([1, 1])(jacobian).weights, jacobian=jacobian)
    harmonized = conflict_diagnostics(MGDA()(jacobian).weights, jacobian=jacobian)
    assert summed["anti_aligned"] == 1 and harmonized["anti_aligned"] == 0
    accumulator = ConflictAccumulator()
    accumulator.add(summed)
    accumulator.add(harmonized)
    summary = accumulator.summary()
    assert summary["steps"] == 2 and summary["negative_min_cos_fraction"] == 0.5


def test_dropped_and_stationary_steps() -> None:
    jacobian = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    record = conflict_diagnostics(torch.tensor([0.5, 0.5, 0.0]), jacobian=jacobian)
    assert record["stationary"] == 1 and math.isnan(record["cos_min"])
    assert record["dropped"] == [2]


def test_near_stationary_float32_steps_are_not_called_conflicts() -> None:
    generator = torch.Generator().manual_seed(3)
    base = torch.randn(1, 1000, generator=generator)
    # Three almost exactly cancelling float32 gradients: MGDA's d is tiny but non-zero.
    jacobian = torch.cat(
        [
            base,
            -base + 3e-3 * torch.randn(1, 1000, generator=generator),
            torch.randn(1, 1000, generator=generator),
        ]
    )
    result = MGDA()(jacobian)
    record = conflict_diagnostics(result.weights, jacobian=jacobian, direction=result.direction)
    assert record["anti_aligned"] == 0
    assert record["stationary"] == 0
    assert record["cos_tolerance"] > 1e-5  # d is ~1e-3 of the norms: float32 round-off shows
    # The same problem in float64 is resolved to far below that tolerance.
    exact = MGDA()(jacobian.double())
    record64 = conflict_diagnostics(exact.weights, jacobian=jacobian.double())
    assert record64["cos_min"] >= -1e-9 and record64["cos_tolerance"] < 1e-6 + 1e-12


def test_gram_path_agrees_with_jacobian_path_when_direction_is_long() -> None:
    jacobian = torch.randn(4, 50, dtype=torch.float64)
    weights = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    exact = conflict_diagnostics(weights, jacobian=jacobian)
    from_gram = conflict_diagnostics(
        weights, gram=jacobian @ jacobian.T, source_dtype=torch.float64
    )
    for k in range(4):
        assert math.isclose(exact[f"cos/{k}"], from_gram[f"cos/{k}"], rel_tol=1e-9)


def test_harmonization_carries_its_gram() -> None:
    jacobian = torch.randn(3, 8, dtype=torch.float64)
    result = FixedWeights()(jacobian)
    torch.testing.assert_close(result.weights, torch.ones(3, dtype=torch.float64))
    torch.testing.assert_close(result.gram, jacobian @ jacobian.T)
