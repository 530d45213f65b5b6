"""IMTL-L: the loss-balancing half of impartial multi-task learning, a learned scale per task."""

from __future__ import annotations

import math

import torch
from torch import nn

from mogradient.scalarizations._base import Scalarization, ScalarizedLoss, check_at_least


class IMTLL(Scalarization):
    """IMTL-L (Liu et al. 2021, ICLR, Towards Impartial Multi-task Learning).

    Each task's loss is scaled by a learned exp(s_k), with -s_k as a regularizer:
    sum_k exp(s_k) L_k - s_k. Minimizing over s_k gives exp(s_k) = 1 / L_k, so every
    scaled loss is driven towards 1 and no task dominates by the size of its loss alone.
    It is UW with the sign of the parameter flipped and without the factor 1/2. The
    gradient-balancing half, IMTL-G, is the [`IMTLG`][mogradient.harmonizers.IMTLG] harmonizer.

    The log-scales are parameters: add ``parameters()`` to the optimizer (without weight
    decay). They start at ``init`` (0: the plain sum, as in TorchJD). A negative loss
    makes exp(s_k) L_k unbounded below, so losses must be non-negative.
    """

    def __init__(self, num_tasks: int, init: float = 0.0) -> None:
        super().__init__(num_tasks)
        if not math.isfinite(init):
            raise ValueError(f"init must be finite, got {init!r}")
        self.init = float(init)
        self.log_scales = nn.Parameter(torch.full((num_tasks,), self.init))

    def check_domain(self, values: torch.Tensor) -> None:
        check_scalable("IMTLL", values)

    def scalarize(self, losses: torch.Tensor) -> ScalarizedLoss:
        scales = torch.exp(self.log_scales)
        loss = (scales * losses).sum() - self.log_scales.sum()
        return ScalarizedLoss(loss, scales.detach().to(losses.dtype))


def check_scalable(method: str, values: torch.Tensor) -> None:
    """Losses a learned scale exp(s) may multiply: non-negative, or the scale diverges."""
    check_at_least(
        method,
        values,
        torch.zeros_like(values),
        strict=False,
        why="with a negative loss exp(s) * loss has no minimum and the scale diverges",
        fix="shift that loss by its lower bound so it stays non-negative",
    )
