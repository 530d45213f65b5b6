"""DB-MTL: log-transformed losses, their shared gradients rescaled to the largest norm."""

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
from mogradient.scalarizations._shared import redirect_shared, shared_gradients, shared_parameters


class DBMTL(Scalarization):
    """Dual-balancing multi-task learning (Lin et al. 2023, arXiv 2308.12029).

    Two balancings. Loss scale: each task trains on log(L_k + eps), whose gradient
    grad L_k / (L_k + eps) no longer grows with the loss's units. Gradient magnitude: on
    the shared parameters, an exponential moving average of each task's log-loss gradient,
    h_k <- beta_t h_k + (1 - beta_t) g_k with g_k = grad_shared log(L_k + eps) and
    beta_t = beta / t^beta_sigma (t the call count, h starting at zero), is rescaled to the
    largest of their norms: d = sum_k (max_j ||h_j|| / (||h_k|| + eps)) h_k. The heads
    keep their own log-loss gradient.

    d is built from the averages, not from this batch's gradients, so the returned loss
    is the surrogate sum_k log(L_k + eps) + <d - sum_k g_k, theta_shared> (the added term
    detached, its value zero): its backward gives the shared parameters d and every other
    parameter the log-loss gradients. ``weights`` is d loss / d L_k = 1 / (L_k + eps);
    ``extras`` holds the scales max_j ||h_j|| / (||h_k|| + eps) and d.

    The moving average, its schedule and the defaults (beta 0.9, beta_sigma 0, eps 1e-8
    in the logarithm and the norms) are LibMTL's (maintained by the paper's first author); I could
    not check the paper's equation numbers, so none are cited. State in ``state_dict``:
    the averages (K x D, in the shared parameters' dtype) and the call count. ``shared``
    are the shared parameters, held by reference and not part of the state.
    """

    def __init__(
        self,
        num_tasks: int,
        shared: Iterable[torch.Tensor],
        beta: float = 0.9,
        beta_sigma: float = 0.0,
        eps: float = 1e-8,
    ) -> None:
        super().__init__(num_tasks)
        self._shared = shared_parameters("DBMTL", shared)
        if not (isinstance(beta, int | float) and 0 <= beta < 1):
            raise ValueError(f"beta must be in [0, 1) (the moving average's decay), got {beta!r}")
        self.beta = float(beta)
        self.beta_sigma = non_negative(beta_sigma, "beta_sigma")
        self.eps = positive(eps, "eps")
        first = self._shared[0]
        size = sum(parameter.numel() for parameter in self._shared)
        self.register_buffer(
            "averages", torch.zeros(num_tasks, size, dtype=first.dtype, device=first.device)
        )
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def check_domain(self, values: torch.Tensor) -> None:
        check_at_least(
            "DBMTL",
            values,
            torch.zeros_like(values),
            strict=False,
            why="DB-MTL takes log(loss + eps)",
            fix="shift that loss by its lower bound so it stays non-negative",
        )

    def scalarize(self, losses: torch.Tensor) -> ScalarizedLoss:
        log_losses = torch.log(losses + self.eps)
        gradients = shared_gradients("DBMTL", log_losses, self._shared)
        self.steps += 1
        decay = self.beta / int(self.steps) ** self.beta_sigma
        self.averages.lerp_(gradients.to(self.averages), 1 - decay)
        norms = self.averages.to(torch.float64).norm(dim=1)
        scales = norms.max() / (norms + self.eps)
        direction = scales.to(self.averages) @ self.averages
        correction = direction.to(gradients) - gradients.sum(0)
        loss = redirect_shared(log_losses.sum(), self._shared, correction)
        weights = (1 / (losses.detach() + self.eps)).clone()
        return ScalarizedLoss(loss, weights, {"scales": scales, "direction": direction})
