"""DualProj against its closed form."""

from __future__ import annotations

import torch

from mogradient.harmonizers import DualProj

from .stacks import TORCHJD_EXAMPLE


def test_dualproj_on_torchjd_example_matches_closed_form() -> None:
    # v >= (1/2, 1/2): the optimum keeps v2 = 1/2 and moves v1 to 22/36 so that g1 . d = 0.
    result = DualProj()(TORCHJD_EXAMPLE)
    torch.testing.assert_close(
        result.weights, torch.tensor([11 / 18, 0.5], dtype=torch.float64), atol=1e-14, rtol=0
    )
    assert abs(float(TORCHJD_EXAMPLE[0] @ result.direction)) < 1e-13
