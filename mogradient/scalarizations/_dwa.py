"""DWA: dynamic weight average, weights from how fast each task's epoch loss falls."""

from __future__ import annotations

import torch

from mogradient.scalarizations._base import Scalarization, ScalarizedLoss, positive


class DWA(Scalarization):
    """Dynamic weight average (Liu, Johns & Davison 2019, CVPR, MTAN; arXiv 1803.10704).

    The loss is sum_k lambda_k L_k with lambda = K softmax(r / T), where
    r_k = L_k(t-1) / L_k(t-2) is the ratio of task k's average loss over the last two
    epochs: a task whose loss stopped falling (r near 1 or above) gets more weight. The
    weights are constants in the backward pass, and uniform (1) until two epochs have
    been averaged: the rule of the authors' code (lorenmt/mtan, im2im_pred/utils.py). Call
    [`end_epoch`][mogradient.scalarizations.DWA.end_epoch] once at the end of every epoch; calling
    it every step gives the per-step variant some implementations use. ``temperature`` T defaults to
    2, the authors' code's default; larger is more uniform.

    State (in ``state_dict``): the running sum of this epoch's losses, its batch count,
    and the last two epoch averages. The ratio needs positive averages.
    """

    def __init__(self, num_tasks: int, temperature: float = 2.0) -> None:
        super().__init__(num_tasks)
        self.temperature = positive(temperature, "temperature")
        self.register_buffer("epoch_sum", torch.zeros(num_tasks, dtype=torch.float64))
        self.register_buffer("epoch_batches", torch.zeros((), dtype=torch.int64))
        # Row 1 is the last epoch's average, row 0 the one before; rows are filled in order.
        self.register_buffer("averages", torch.ones(2, num_tasks, dtype=torch.float64))
        self.register_buffer("epochs_averaged", torch.zeros((), dtype=torch.int64))

    def scalarize(self, losses: torch.Tensor) -> ScalarizedLoss:
        if int(self.epochs_averaged) < 2:
            weights = torch.ones_like(self.epoch_sum)
        else:
            rates = self.averages[1] / self.averages[0]
            weights = len(losses) * torch.softmax(rates / self.temperature, dim=0)
        self.epoch_sum += losses.detach().to(self.epoch_sum)
        self.epoch_batches += 1
        weights = weights.to(losses)
        return ScalarizedLoss((weights * losses).sum(), weights)

    def end_epoch(self) -> None:
        """Average this epoch's losses into the history; nothing happens after an empty epoch."""
        batches = int(self.epoch_batches)
        if batches == 0:
            return
        average = self.epoch_sum / batches
        bad = torch.nonzero(average <= 0).flatten().tolist()
        if bad:
            raise ValueError(
                f"DWA: task {bad[0]}'s average loss this epoch is {float(average[bad[0]])!r}; "
                "the descending rate L(t-1) / L(t-2) needs positive averages (shift that loss "
                "by its lower bound so it stays positive)"
            )
        self.averages[0] = self.averages[1]
        self.averages[1] = average
        self.epochs_averaged.fill_(min(int(self.epochs_averaged) + 1, 2))
        self.epoch_sum.zero_()
        self.epoch_batches.zero_()
