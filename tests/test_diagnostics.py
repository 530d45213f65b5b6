"""Conflict diagnostics against cosines computed directly from the vectors."""

from __future__ import annotations

import math

import torch

from mogradient import MGDA, ConflictAccumulator, FixedWeights, conflict_diagnostics


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
