"""GradVac against TorchJD and its targets."""

from __future__ import annotations

import math

import pytest
import torch

from mogradient.harmonizers import GradVac, PCGrad

from .stacks import random_jacobian

aggregation = pytest.importorskip("torchjd.aggregation")


def test_gradvac_matches_torchjd_over_several_steps() -> None:
    # Same update and the same per-task shuffle: torch.randperm(K - 1) per task, so a
    # generator seeded like TorchJD's global RNG visits the pairs in the same order.
    # eps=0 on both sides because ours is relative to the largest norm, TorchJD's absolute.
    ours = GradVac(beta=0.3, eps=0.0, seed=11)
    torch.manual_seed(11)
    theirs = aggregation.GradVac(beta=0.3, eps=0.0)
    for step in range(6):
        jacobian = random_jacobian(step, 4, 6, spread=0.5)
        expected = theirs(jacobian)
        torch.testing.assert_close(ours(jacobian).direction, expected, atol=1e-12, rtol=1e-12)


def test_gradvac_first_step_is_pcgrad_for_two_objectives() -> None:
    # Targets start at 0, and the correction towards 0 is PCGrad's projection.
    jacobian = torch.tensor([[1.0, 0.0], [-1.0, 1.0]], dtype=torch.float64)
    gradvac = GradVac(beta=0.25, seed=0)
    torch.testing.assert_close(gradvac(jacobian).weights, PCGrad(seed=0)(jacobian).weights)
    cosine = -1 / math.sqrt(2)
    assert gradvac.targets == pytest.approx({(0, 1): 0.25 * cosine, (1, 0): 0.25 * cosine})


def test_gradvac_state_is_keyed_by_original_indices() -> None:
    gradvac = GradVac(seed=0)
    jacobian = random_jacobian(2, 3, 5)
    gradvac(jacobian)
    before = gradvac.targets
    assert set(before) == {(i, j) for i in range(3) for j in range(3) if i != j}
    jacobian[1] = 0.0  # objective 1 is dropped for this step
    gradvac(jacobian)
    after = gradvac.targets
    for key in [(0, 1), (1, 0), (1, 2), (2, 1)]:
        assert after[key] == before[key]
    assert after[(0, 2)] != before[(0, 2)] and after[(2, 0)] != before[(2, 0)]
    gradvac.reset()
    assert gradvac.targets == {}


def test_gradvac_reaches_its_targets() -> None:
    # With a positive target every corrected gradient's cosine to the others is lifted to it.
    gradvac = GradVac(beta=1.0, eps=0.0, seed=0)
    gradvac._targets.update({(0, 1): 0.5, (1, 0): 0.5})
    jacobian = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    weights = gradvac(jacobian).weights
    # g0' = g0 + a g1 with cos(g0', g1) = 0.5: a * 2 / sqrt(1 + 4 a^2) = 0.5.
    assert weights[1] == pytest.approx(1 + 1 / (2 * math.sqrt(3)), rel=1e-12)
    assert weights[0] == pytest.approx(1 + 2 / math.sqrt(3), rel=1e-12)
