"""What the gradient-aware scalarizations share (_shared.py): the shared parameters are
checked when the method is built, and losses without a graph are refused."""

from __future__ import annotations

import pytest
from torch import nn

from mogradient.scalarizations import DBMTL, GradNorm, MoCo

from .helpers import Problem


@pytest.mark.parametrize(
    ("build", "error", "message"),
    [
        (lambda problem: GradNorm(3, []), ValueError, "GradNorm: shared is empty"),
        (
            lambda problem: MoCo(3, nn.Linear(2, 2).requires_grad_(False).parameters()),
            ValueError,
            r"shared\[0\].*does not require grad",
        ),
        (
            lambda problem: DBMTL(3, problem.trunk.named_parameters()),
            TypeError,
            "not named_parameters",
        ),
    ],
    ids=["empty", "frozen", "named"],
)
def test_bad_shared_parameters_are_named(build, error: type[Exception], message: str) -> None:
    problem = Problem()
    with pytest.raises(error, match=message):
        build(problem)


def test_losses_without_a_graph_are_refused() -> None:
    problem = Problem()
    with pytest.raises(ValueError, match=r"MoCo differentiates the losses but they carry no graph"):
        MoCo(3, problem.shared)(problem.losses().detach())
