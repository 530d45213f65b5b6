"""IMTL-G: equal projections on the unit gradients."""

from __future__ import annotations

import math

import pytest
import torch

from mogradient.harmonizers import IMTLG

from .stacks import random_jacobian

aggregation = pytest.importorskip("torchjd.aggregation")


@pytest.mark.parametrize("seed", range(4))
def test_imtlg_gives_equal_projections(seed: int) -> None:
    jacobian = random_jacobian(seed, 2 + seed, 8, spread=2.0)
    result = IMTLG()(jacobian)
    units = jacobian / jacobian.norm(dim=1, keepdim=True)
    projections = units @ result.direction
    torch.testing.assert_close(
        projections, projections.mean().expand_as(projections), atol=1e-10, rtol=1e-10
    )
    assert result.weights.sum() == pytest.approx(1.0, abs=1e-12)
    assert projections.min() > 0 and result.kkt_residual < 1e-10


def test_imtlg_negative_sum_keeps_projections_positive() -> None:
    # Here sum(pinv(G) norms) < 0: TorchJD's (and the paper's) sum-to-one normalization
    # returns d with d . u_k < 0 for every k; we divide by |sum| instead.
    jacobian = torch.tensor(
        [[-0.8, 0.0, -0.7], [0.5, -1.3, 0.2], [0.0, -0.1, 0.0]], dtype=torch.float64
    )
    result = IMTLG()(jacobian)
    assert result.fallback == "negative_sum"
    torch.testing.assert_close(result.direction, -aggregation.IMTLG()(jacobian))
    units = jacobian / jacobian.norm(dim=1, keepdim=True)
    assert (units @ result.direction).min() > 0


def test_imtlg_cancelling_gradients_give_zero() -> None:
    angles = torch.tensor([0.0, 2 * math.pi / 3, 4 * math.pi / 3], dtype=torch.float64)
    jacobian = torch.stack([angles.cos(), angles.sin()], dim=1)
    result = IMTLG()(jacobian)
    assert result.fallback == "degenerate" and (result.weights == 0).all()
