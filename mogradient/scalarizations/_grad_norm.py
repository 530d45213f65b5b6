"""GradNorm: task weights that make gradient norms follow each task's training rate."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from mogradient.scalarizations._base import (
    Scalarization,
    ScalarizedLoss,
    check_at_least,
    non_negative,
    positive,
)
from mogradient.scalarizations._shared import shared_gradients, shared_parameters


class GradNorm(Scalarization):
    """Gradient normalization (Chen et al. 2018, ICML, arXiv 1711.02257).

    The loss is sum_k w_k L_k with learned weights. GradNorm wants the gradient norm
    G_k = ||grad_W (w_k L_k)|| of each weighted loss on the shared parameters W (the last
    shared layer, ``shared``) to be the mean norm times the task's relative inverse
    training rate: target_k = mean_j(G_j) r_k^alpha, r_k = L~_k / mean_j(L~_j) with
    L~_k = L_k / L_k(0). Each call steps the weights by plain gradient descent (rate ``lr``)
    on L_grad = sum_k |G_k - target_k| (the targets held constant). Since
    G_k = w_k ||grad_W L_k|| for w_k >= 0, d L_grad / d w_k = sign(G_k - target_k) ||grad_W L_k||:
    first-order, no double backward. The weights are then clipped at zero and renormalized
    to sum to K, as the paper does. A weight at zero is not stuck: its G_k = 0 is below its
    target, so the next step raises it.

    As in the paper's training loop, the returned loss uses the weights from before this
    call's step; the stepped weights serve the next call. ``weights`` is those w,
    ``extras`` holds L_grad, the norms ||grad_W L_k||, the targets and the next weights.
    L(0) is the first call's losses (kept in a buffer), so losses must be positive.
    ``alpha`` 1.5 is LibMTL's default (the paper tunes it per problem). ``lr`` 0.025 is
    our choice: no rate for w could be checked. LibMTL learns w as K softmax(z) instead,
    stepped by the training optimizer; the two agree on L_grad
    (tests/scalarizations/test_grad_norm.py). Every call is a training step (it moves
    the weights). State in ``state_dict``: the weights, L(0) and whether it is set.
    ``shared`` is held by reference and not part of the state.
    """

    def __init__(
        self,
        num_tasks: int,
        shared: Iterable[torch.Tensor],
        alpha: float = 1.5,
        lr: float = 0.025,
    ) -> None:
        super().__init__(num_tasks)
        self._shared = shared_parameters("GradNorm", shared)
        self.alpha = non_negative(alpha, "alpha")
        self.lr = positive(lr, "lr")
        self.register_buffer("task_weights", torch.ones(num_tasks, dtype=torch.float64))
        self.register_buffer("initial_losses", torch.ones(num_tasks, dtype=torch.float64))
        self.register_buffer("started", torch.zeros((), dtype=torch.bool))

    def check_domain(self, values: torch.Tensor) -> None:
        check_at_least(
            "GradNorm",
            values,
            torch.zeros_like(values),
            strict=True,
            why="GradNorm divides by the first losses and compares loss ratios",
            fix="shift that loss by its lower bound so it stays positive",
        )

    def scalarize(self, losses: torch.Tensor) -> ScalarizedLoss:
        gradients = shared_gradients("GradNorm", losses, self._shared)
        norms = gradients.to(torch.float64).norm(dim=1).to(self.task_weights)
        current = losses.detach().to(self.task_weights)
        if not bool(self.started):
            self.initial_losses.copy_(current)
            self.started.fill_(True)
        weights = self.task_weights.clone()
        scaled_norms = weights * norms
        ratios = current / self.initial_losses
        targets = scaled_norms.mean() * (ratios / ratios.mean()) ** self.alpha
        gap = scaled_norms - targets
        stepped = (weights - self.lr * torch.sign(gap) * norms).clamp_min(0)
        if not stepped.sum() > 0:
            raise ValueError(
                "GradNorm: every task weight fell to zero in one step; lower lr (the step "
                "on w_k is lr times the norm of task k's shared gradient)"
            )
        self.task_weights.copy_(stepped * (len(stepped) / stepped.sum()))
        loss = (weights.to(losses) * losses).sum()
        extras = {
            "gradnorm_loss": gap.abs().sum(),
            "gradient_norms": norms,
            "targets": targets,
            "next_weights": self.task_weights.clone(),
        }
        return ScalarizedLoss(loss, weights.to(losses), extras)
