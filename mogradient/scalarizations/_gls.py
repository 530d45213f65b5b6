"""GLS: the geometric mean of the task losses."""

from __future__ import annotations

import torch

from mogradient.scalarizations._base import Scalarization, ScalarizedLoss, check_at_least


class GLS(Scalarization):
    """Geometric loss strategy (Chennupati et al. 2019, MultiNet++, CVPR Workshops).

    The loss is the geometric mean (prod_k L_k)^(1/K), so its gradient is
    G / K * sum_k grad L_k / L_k with G the mean itself: every task counts by its
    *relative* change, and a task cannot dominate by the scale of its loss. Computed as
    exp(mean_k log L_k), which neither overflows nor underflows where the product would.
    The logarithm needs strictly positive losses. Stateless; ``num_tasks`` is optional.
    """

    def __init__(self, num_tasks: int | None = None) -> None:
        super().__init__(num_tasks)

    def check_domain(self, values: torch.Tensor) -> None:
        check_at_least(
            "GLS",
            values,
            torch.zeros_like(values),
            strict=True,
            why="the geometric mean takes its logarithm",
            fix="add a small positive constant to that loss (e.g. loss + 1e-8) or use another "
            "method for losses that reach zero",
        )

    def scalarize(self, losses: torch.Tensor) -> ScalarizedLoss:
        loss = torch.exp(torch.log(losses).mean())
        weights = loss.detach() / (len(losses) * losses.detach())
        return ScalarizedLoss(loss, weights)
