"""FAMO: fast adaptive multitask optimization, weights learned from how each loss moved."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mogradient.scalarizations._base import (
    Scalarization,
    ScalarizedLoss,
    check_at_least,
    checked_vector,
    non_negative,
    positive,
)

# torch.optim.Adam's defaults, which the official FAMO code uses for its logits.
_ADAM_BETAS = (0.9, 0.999)
_ADAM_EPS = 1e-8


class FAMO(Scalarization):
    """Fast adaptive multitask optimization (Liu et al. 2023, NeurIPS; arXiv 2306.03792).

    FAMO aims to decrease every task's log-loss at the same rate without computing any
    per-task gradient. The loss is c sum_k z_k log(L_k - b_k + eps) with task weights
    z = softmax(w) and c = 1 / sum_k z_k / (L_k - b_k + eps) held constant, so the model's
    gradient is the convex combination sum_k (c z_k / (L_k - b_k + eps)) grad L_k: the
    weighted gradient of the log-losses, rescaled. The logits w are then learned from
    the losses themselves: after the optimizer step,
    [`update`][mogradient.scalarizations.FAMO.update] takes the realized log-loss decrease delta_k =
    log(L_k^before - b_k + eps) - log(L_k^after - b_k + eps) on the same batch, and steps w along
    -J_softmax^T delta (tasks that fell more lose weight) with its own Adam (L2 decay
    ``weight_decay``, the gamma of the authors' code). Both steps, and the 1e-8 guard ``eps``, are
    those of the authors' code (Cranial-XIX/FAMO, famo.py).

    Call order each step: ``result = famo(losses)``, ``result.loss.backward()``,
    ``optimizer.step()``, then ``famo.update(losses_recomputed_after_the_step)`` (same
    batch, e.g. under ``torch.no_grad()``). The logits are buffers, not parameters: FAMO
    owns their optimizer, so ``parameters()`` is empty and adding it to the model's
    optimizer is harmless. ``lr`` 0.025 is the authors' code's default (``w_lr``);
    ``weight_decay`` 1e-3, as in TorchJD, is the gamma its run scripts use for CelebA,
    NYU-v2 and QM9 (Cityscapes: 1e-2; its class defaults are 1e-2 in famo.py and 1e-5 in
    methods/weight_methods.py). ``min_losses`` b (default 0) are lower bounds of the
    losses; a loss below its bound has no logarithm. State in ``state_dict``: logits,
    Adam's moments and step count, the pending losses.
    """

    needs_losses_after_step = True

    def __init__(
        self,
        num_tasks: int,
        lr: float = 0.025,
        weight_decay: float = 1e-3,
        min_losses: Sequence[float] | torch.Tensor | None = None,
        eps: float = 1e-8,
    ) -> None:
        super().__init__(num_tasks)
        self.lr = non_negative(lr, "lr")
        self.weight_decay = non_negative(weight_decay, "weight_decay")
        self.eps = positive(eps, "eps")
        min_losses = checked_vector(min_losses, "min_losses", False, num_tasks)
        zeros = torch.zeros(num_tasks, dtype=torch.float64)
        self.register_buffer("min_losses", zeros.clone() if min_losses is None else min_losses)
        self.register_buffer("logits", zeros.clone())
        self.register_buffer("adam_mean", zeros.clone())
        self.register_buffer("adam_square", zeros.clone())
        self.register_buffer("adam_steps", torch.zeros((), dtype=torch.int64))
        # The losses of the last call, waiting for update(); `pending` says whether they are.
        self.register_buffer("losses_before", zeros.clone())
        self.register_buffer("pending", torch.zeros((), dtype=torch.bool))

    def check_domain(self, values: torch.Tensor) -> None:
        check_at_least(
            "FAMO",
            values,
            self.min_losses.detach().to("cpu", torch.float64),
            strict=False,
            why="FAMO takes log(loss - min_losses + eps)",
            fix="lower that task's min_losses entry to a true lower bound of its loss",
        )

    def task_weights(self) -> torch.Tensor:
        """z = softmax(w): the paper's task weights, before the 1 / (L - b) rescaling."""
        return torch.softmax(self.logits, dim=0)

    def scalarize(self, losses: torch.Tensor) -> ScalarizedLoss:
        shifted = losses - self.min_losses.to(losses) + self.eps
        z = self.task_weights().to(losses)
        normalizer = 1.0 / (z / shifted.detach()).sum()
        loss = normalizer * (z * torch.log(shifted)).sum()
        self.losses_before.copy_(losses.detach())
        self.pending.fill_(True)
        weights = normalizer * z / shifted.detach()
        return ScalarizedLoss(loss, weights, {"task_weights": z})

    def update(self, losses_after_step: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """One Adam step on the logits from the losses after the model's step (same batch)."""
        after = self.validated_losses(losses_after_step).detach().to(self.logits)
        if not bool(self.pending):
            raise ValueError(
                "FAMO.update() needs this step's losses first: call the scalarization on "
                "them, backward and step the optimizer, then update() once"
            )
        bound = self.min_losses - self.eps
        decrease = torch.log(self.losses_before - bound) - torch.log(after - bound)
        z = self.task_weights()
        # The softmax's Jacobian (symmetric) applied to the decrease.
        gradient = z * (decrease - z @ decrease) + self.weight_decay * self.logits
        self._adam_step(gradient)
        self.pending.fill_(False)

    def _adam_step(self, gradient: torch.Tensor) -> None:
        """Adam as torch.optim.Adam computes it; moments live in buffers so they checkpoint."""
        beta1, beta2 = _ADAM_BETAS
        self.adam_steps += 1
        steps = int(self.adam_steps)
        self.adam_mean.mul_(beta1).add_(gradient, alpha=1 - beta1)
        self.adam_square.mul_(beta2).addcmul_(gradient, gradient, value=1 - beta2)
        scale = (1 - beta2**steps) ** 0.5
        denominator = self.adam_square.sqrt() / scale + _ADAM_EPS
        self.logits.addcdiv_(self.adam_mean, denominator, value=-self.lr / (1 - beta1**steps))
