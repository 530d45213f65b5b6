"""MoCo: tracked per-task gradients and a projected weight vector, against gradient bias."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from mogradient.gradients import objective_gradients
from mogradient.scalarizations.base import (
    Scalarization,
    ScalarizedLoss,
    check_at_least,
    non_negative,
    positive,
)

# LibMTL's guard when MoCo (normalize=True) or DB-MTL divides by a gradient norm.
NORM_EPS = 1e-8


def shared_parameters(method: str, shared: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The shared parameters a gradient-aware scalarization differentiates, checked."""
    tensors = list(shared)
    if not tensors:
        raise ValueError(
            f"{method}: shared is empty; pass the shared parameters the task gradients are "
            "taken on, e.g. list(model.trunk.parameters())"
        )
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"{method}: shared[{index}] is a {type(tensor).__name__}, not a tensor; pass "
                "parameters such as model.trunk.parameters() (not named_parameters())"
            )
        if not tensor.requires_grad:
            raise ValueError(
                f"{method}: shared[{index}] (shape {tuple(tensor.shape)}) does not require "
                "grad; pass only the trainable shared parameters"
            )
    return tensors


def shared_gradients(method: str, losses: torch.Tensor, shared: list[torch.Tensor]) -> torch.Tensor:
    """K x D gradients of the losses on the shared parameters, the graph kept for backward."""
    if not losses.requires_grad:
        raise ValueError(
            f"{method} differentiates the losses but they carry no graph; call it on the "
            "training losses, outside torch.no_grad()"
        )
    return objective_gradients(losses, shared, retain_graph=True)


def redirect_shared(
    loss: torch.Tensor, shared: list[torch.Tensor], correction: torch.Tensor
) -> torch.Tensor:
    """``loss`` with the same value, whose backward adds ``correction`` to the shared gradient.

    Returns loss + <c, theta> - <c, theta>.detach() for the flat, detached c: the added
    term is exactly zero, and its gradient is c on the shared parameters, nothing elsewhere.
    """
    pieces = torch.split(correction.detach(), [parameter.numel() for parameter in shared])
    term = sum(
        (piece.view_as(parameter).to(parameter.dtype) * parameter).sum()
        for piece, parameter in zip(pieces, shared, strict=True)
    )
    return loss + (term - term.detach())


def simplex_projection(vector: torch.Tensor) -> torch.Tensor:
    """The Euclidean projection of a 1-D vector onto the probability simplex.

    Sort-based (Held, Wolfe & Crowder 1974; Duchi et al. 2008, Fig. 1): with u sorted
    in decreasing order, theta = (sum_{j <= rho} u_j - 1) / rho for the largest rho with
    u_rho > (sum_{j <= rho} u_j - 1) / rho, and the projection is max(v - theta, 0).
    """
    ordered = torch.sort(vector, descending=True).values
    excess = ordered.cumsum(0) - 1
    ranks = torch.arange(1, len(vector) + 1, dtype=vector.dtype, device=vector.device)
    # The first entry always qualifies (u_1 - (u_1 - 1) = 1 > 0).
    count = int(torch.nonzero(ordered - excess / ranks > 0).max()) + 1
    return (vector - excess[count - 1] / count).clamp_min(0)


class MoCo(Scalarization):
    """Stochastic multi-objective gradient correction (Fernando et al. 2023, ICLR, Algorithm 1).

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
    d loss / d L_k; ``extras["direction"]`` is d. I follow the paper's update order (y,
    then lambda from the new Y, then d) and its Euclidean projection onto the simplex; the
    paper's projection of y_k onto a ball of radius L_k (a bound used in the analysis) is
    left out. I could not check the paper's equation numbers, hence the reference to
    Algorithm 1 only.

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
        self.normalize = bool(normalize)
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
        self.lambdas.copy_(simplex_projection(self.lambdas - step_size * (gram @ self.lambdas)))
        direction = self.lambdas.to(self.tracked) @ self.tracked
        lambdas = self.lambdas.to(losses)
        correction = direction.to(gradients) - lambdas.to(gradients) @ gradients
        loss = redirect_shared((lambdas * losses).sum(), self._shared, correction)
        return ScalarizedLoss(loss, lambdas.detach().clone(), {"direction": direction})
