"""UPGrad against TorchJD and its closed form."""

from __future__ import annotations

import pytest
import torch

from mogradient.harmonizers import UPGrad

from .stacks import TORCHJD_EXAMPLE, random_jacobian

aggregation = pytest.importorskip("torchjd.aggregation")


def test_upgrad_reproduces_torchjd_regression_value() -> None:
    # TorchJD's documented output; its default projector solves on G/tr(G) + 1e-4 I.
    result = UPGrad(reg_eps=1e-4)(TORCHJD_EXAMPLE)
    expected = torch.tensor([0.2929, 1.9004, 1.9004], dtype=torch.float64)
    torch.testing.assert_close(result.direction, expected, atol=5e-5, rtol=0)
    torch.testing.assert_close(
        result.direction, aggregation.UPGrad()(TORCHJD_EXAMPLE), atol=1e-9, rtol=0
    )


def test_exact_upgrad_on_torchjd_example_matches_closed_form() -> None:
    # G = [[18, -22], [-22, 38]]. Projecting g1/2: v = (1/2, 22/76) (G v = (50/19, 0) >= 0);
    # projecting g2/2: v = (22/36, 1/2). Their sum is (10/9, 15/19).
    result = UPGrad()(TORCHJD_EXAMPLE)
    weights = torch.tensor([10 / 9, 15 / 19], dtype=torch.float64)
    torch.testing.assert_close(result.weights, weights, atol=1e-14, rtol=0)
    torch.testing.assert_close(result.direction, weights @ TORCHJD_EXAMPLE, atol=1e-13, rtol=0)
    assert result.direction[0] == pytest.approx(0.2924, abs=1e-4)
    assert result.kkt_residual < 1e-14


def test_too_few_preferences_is_an_error() -> None:
    with pytest.raises(ValueError, match="one preference per objective"):
        UPGrad(pref_vector=[1.0, 1.0])(random_jacobian(0, 3, 4))
