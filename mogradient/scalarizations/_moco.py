"""MoCo: tracked per-task gradients and a projected weight vector, against gradient bias."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from mogradient.harmonizers._base import validated_flag
from mogradient.harmonizers._simplex import project_to_simplex
from mogradient.scalarizations._base import (
    Scalarization,
    ScalarizedLoss,
    check_at_least,
    non_negative,
    positive,
)
from mogradient.scalarizations._shared import redirect_shared, shared_gradients, shared_parameters

# LibMTL's guard when MoCo (normalize=True) or DB-MTL divides by a gradient norm.
NORM_EPS = 1e-8


class MoCo(Scalarization):
    """Stochastic multi-objective gradient correction (Fernando et al. 2023, ICLR).

    MGDA-type weights computed from one mini-batch's gradients are biased; MoCo tracks
    each task's gradient instead and moves the weights by small projected steps, which
    converges without growing the batch. Each call, with t the call count:

    * y_k <- y_k - beta_t (y_k - g_k) with g_k = grad_shared L_k, beta_t = beta / t^beta_sigma;
    * lambda <- Proj_simplex(lambda - gamma_t (Y Y^T + rho I) lambda),
      gamma_t = gamma / t^gamma_sigma;
    * the shared parameters' update direction is d = Y^T lambda (Y: the K tracked rows).

    d is not the gradient of any combination of this batch's losses, so the returned
    loss is the surrogate sum_k lambda_k L_k + <d - sum_k lambda_k g_k, theta_shared> (the
    added term detached, its value zero): its backward gives the shared parameters d and
    every other parameter (the heads) the lambda-weighted gradient. ``weights`` is lambda,
    d loss / d L_k; ``extras["direction"]`` is d. The update order (y, then lambda from the
    new Y, then d) and the Euclidean projection onto the simplex are those of the first
    author's code (heshandevaka/Trade-Off-MOL, ``LibMTL/weighting/MoCo.py``); the
    projection of y_k onto a ball of radius L_k (a bound for the analysis) is left out.

    Defaults are LibMTL's (beta 0.5, beta_sigma 0.5, gamma 0.1, gamma_sigma 0.5, rho 0),
    whose code follows the authors' and differs in two ways: lambda is renormalized by
    a softmax instead of projected, and each gradient is first rescaled to norm L_k,
    g_k L_k / (||g_k|| + 1e-8): ``normalize=True`` does that rescaling here (losses must
    then be non-negative). State in ``state_dict``: Y (K x D, in the shared parameters'
    dtype), lambda, the call count. ``shared`` are the shared parameters (say, the trunk),
    held by reference and not part of the state.
    """

    def __init__(
        self,
        num_tasks: int,
        shared: Iterable[torch.Tensor],
        beta: float = 0.5,
        beta_sigma: float = 0.5,
        gamma: float = 0.1,
        gamma_sigma: float = 0.5,
        rho: float = 0.0,
        normalize: bool = False,
    ) -> None:
        super().__init__(num_tasks)
        self._shared = shared_parameters("MoCo", shared)
        if not (isinstance(beta, int | float) and 0 < beta <= 1):
            raise ValueError(f"beta must be in (0, 1] (the tracking step), got {beta!r}")
        self.beta = float(beta)
        self.beta_sigma = non_negative(beta_sigma, "beta_sigma")
        self.gamma = positive(gamma, "gamma")
        self.gamma_sigma = non_negative(gamma_sigma, "gamma_sigma")
        self.rho = non_negative(rho, "rho")
        self.normalize = validated_flag(normalize, "normalize")
        first = self._shared[0]
        size = sum(parameter.numel() for parameter in self._shared)
        self.register_buffer(
            "tracked", torch.zeros(num_tasks, size, dtype=first.dtype, device=first.device)
        )
        self.register_buffer(
            "lambdas", torch.full((num_tasks,), 1.0 / num_tasks, dtype=torch.float64)
        )
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def check_domain(self, values: torch.Tensor) -> None:
        if self.normalize:
            check_at_least(
                "MoCo",
                values,
                torch.zeros_like(values),
                strict=False,
                why="normalize=True rescales each gradient to the norm of its loss",
                fix="shift that loss by its lower bound, or use normalize=False",
            )

    def scalarize(self, losses: torch.Tensor) -> ScalarizedLoss:
        gradients = shared_gradients("MoCo", losses, self._shared)
        target = gradients
        if self.normalize:
            norms = gradients.norm(dim=1, keepdim=True)
            target = gradients / (norms + NORM_EPS) * losses.detach().to(gradients)[:, None]
        self.steps += 1
        step = int(self.steps)
        self.tracked.lerp_(target.to(self.tracked), self.beta / step**self.beta_sigma)
        tracked = self.tracked.to(torch.float64)
        gram = tracked @ tracked.T + self.rho * torch.eye(
            len(tracked), dtype=torch.float64, device=tracked.device
        )
        step_size = self.gamma / step**self.gamma_sigma
        self.lambdas.copy_(project_to_simplex(self.lambdas - step_size * (gram @ self.lambdas)))
        direction = self.lambdas.to(self.tracked) @ self.tracked
        lambdas = self.lambdas.to(losses)
        correction = direction.to(gradients) - lambdas.to(gradients) @ gradients
        loss = redirect_shared((lambdas * losses).sum(), self._shared, correction)
        return ScalarizedLoss(loss, lambdas.detach().clone(), {"direction": direction})
