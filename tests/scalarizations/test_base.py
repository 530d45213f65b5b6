"""The Scalarization base class: losses checked and named (non-finite, out of a method's
domain, wrong count or shape, not floating point), num_tasks, update() where a method
learns nothing after the step."""

from __future__ import annotations

import pytest
import torch

from mogradient.scalarizations import FAMO, GLS, IMTLL, STCH, UW, Scalarization

from .helpers import F64


@pytest.mark.parametrize(
    ("method", "values", "message"),
    [
        (GLS(), [1.0, float("nan")], r"task 1's loss is nan"),
        (STCH(mu=1.0), [float("inf"), 1.0], r"task 0's loss is inf"),
        (GLS(), [1.0, 0.0], r"GLS: task 1's loss is 0.0 but must be above 0.0.*logarithm"),
        (UW(2), [-0.1, 1.0], r"UW: task 0's loss is -0.1 but must be at least 0.0"),
        (IMTLL(2), [1.0, -2.0], r"IMTLL: task 1's loss is -2.0"),
        (FAMO(2, min_losses=[0.5, 0.0]), [0.4, 1.0], r"FAMO: task 0.*min_losses"),
        (UW(3), [1.0, 2.0], r"built for 3 tasks but got 2 losses"),
        (STCH(mu=1.0, preferences=[1.0, 1.0]), [1.0], r"built for 2 tasks"),
        (GLS(), torch.ones(2, 2), r"must be K >= 1 scalars"),
        (GLS(), [], r"must be K >= 1 scalars"),
    ],
)
def test_invalid_losses_are_named(method: Scalarization, values, message: str) -> None:
    if not isinstance(values, torch.Tensor):
        values = [torch.tensor(value, dtype=F64) for value in values]
    with pytest.raises(ValueError, match=message):
        method(values)


def test_misuse_and_bad_settings_raise() -> None:
    with pytest.raises(TypeError, match="floating point"):
        GLS()(torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="does not learn from the losses after the step"):
        UW(2).update(torch.ones(2))
    with pytest.raises(ValueError, match="num_tasks must be a positive integer"):
        UW(0)
