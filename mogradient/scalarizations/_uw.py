"""UW: uncertainty weighting, a learned log-variance per task."""

from __future__ import annotations

import math

import torch
from torch import nn

from mogradient.scalarizations._base import Scalarization, ScalarizedLoss, check_at_least


class UW(Scalarization):
    """Uncertainty weighting (Kendall, Gal & Cipolla 2018, CVPR).

    Each task is read as a Gaussian likelihood with its own learned noise sigma_k: the loss
    is the joint negative log-likelihood sum_k exp(-s_k) L_k / 2 + s_k / 2 with
    s_k = log sigma_k^2, the log-variance being learned rather than the variance (as in
    TorchJD, and in the MTAN authors' implementation of this method, lorenmt/mtan,
    im2im_pred/utils.py). A task with a large loss earns a large sigma and a small weight
    exp(-s_k) / 2; the s_k / 2 term keeps sigma from growing without bound. At the optimum
    over s, exp(s_k) = L_k, so each task's gradient is scaled by 1 / (2 L_k). (To weigh a
    task by exp(-s_k) without the 1/2, give it twice its loss.)

    The log-variances are parameters: add ``parameters()`` to the optimizer (without weight
    decay, which would pull them to zero). ``init`` is their starting value: 0 (weights
    1/2) as in TorchJD; LibMTL starts at -0.5. A negative loss makes the
    objective unbounded below in s_k, so losses must be non-negative.
    """

    def __init__(self, num_tasks: int, init: float = 0.0) -> None:
        super().__init__(num_tasks)
        if not math.isfinite(init):
            raise ValueError(f"init must be finite, got {init!r}")
        self.init = float(init)
        self.log_variances = nn.Parameter(torch.full((num_tasks,), self.init))

    def check_domain(self, values: torch.Tensor) -> None:
        check_at_least(
            "UW",
            values,
            torch.zeros_like(values),
            strict=False,
            why="with a negative loss the learned log-variance runs off to infinity",
            fix="shift that loss by its lower bound so it stays non-negative",
        )

    def scalarize(self, losses: torch.Tensor) -> ScalarizedLoss:
        precision = 0.5 * torch.exp(-self.log_variances)
        loss = (precision * losses).sum() + 0.5 * self.log_variances.sum()
        return ScalarizedLoss(loss, precision.detach().to(losses.dtype))
