"""Flow-GRPO's SDE step and its Gaussian log-probability: the policy that RL objectives score.

The deterministic flow ODE has no likelihood per step, so Flow-GRPO samples from an SDE
with the same marginals. At noise level t (x_t = (1 - t) x0 + t noise) with step dt < 0:

    sigma_t = eta * sqrt(t / (1 - t))        (t = 1 divides by 1 - sigmas[1] instead)
    mean    = x (1 + sigma_t^2 dt / (2 t)) + v (1 + sigma_t^2 (1 - t) / (2 t)) dt
    x_next  = mean + sigma_t sqrt(-dt) * N(0, I)

The log-probability of x_next is the Gaussian log-density averaged (not summed) over the
latent's C x H x W entries, as the reference does; in float32 at least, since half
precision overflows in the mean. eta = 0 is the Euler step and has no density.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def noise_scale(sigma: Tensor, sigma_max: float, eta: float) -> Tensor:
    """sigma_t = eta sqrt(t / (1 - t)); at t = 1 the denominator uses sigmas[1] (``sigma_max``)."""
    _check_eta(eta)
    if not 0.0 <= sigma_max < 1.0:
        raise ValueError(
            f"sigma_max (the schedule's sigmas[1]) must lie in [0, 1), got {sigma_max}"
        )
    denominator = 1 - torch.where(sigma >= 1, torch.full_like(sigma, sigma_max), sigma)
    return eta * torch.sqrt(sigma / denominator)


def sde_step_statistics(
    x: Tensor,
    v: Tensor,
    sigma: Tensor | float,
    sigma_next: Tensor | float,
    sigma_max: float,
    eta: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Mean, standard deviation sigma_t sqrt(-dt), and sigma_t of x_next given x_t = ``x``.

    ``sigma`` and ``sigma_next`` are scalars or one level per sample (shape [B]); they are
    broadcast over the latent dimensions. Differentiable in ``v`` (the trained velocity).
    Computed in ``x``'s dtype promoted to at least float32.
    """
    if x.shape != v.shape or x.ndim < 2:
        raise ValueError(
            f"x and v must share a shape (B, ...), got {tuple(x.shape)} and {tuple(v.shape)}"
        )
    dtype = torch.promote_types(torch.promote_types(x.dtype, v.dtype), torch.float32)
    sigma, sigma_next = (_per_sample(s, x, dtype) for s in (sigma, sigma_next))
    if not bool(((sigma > 0) & (sigma <= 1) & (sigma_next >= 0) & (sigma_next < sigma)).all()):
        raise ValueError(
            "need 0 <= sigma_next < sigma <= 1 (the sampler runs from noise to data), got "
            f"sigma {sigma.flatten().tolist()} and sigma_next {sigma_next.flatten().tolist()}"
        )
    x, v = x.to(dtype), v.to(dtype)
    dt = sigma_next - sigma
    scale = noise_scale(sigma, sigma_max, eta)
    mean = (
        x * (1 + scale**2 / (2 * sigma) * dt) + v * (1 + scale**2 * (1 - sigma) / (2 * sigma)) * dt
    )
    return mean, scale * torch.sqrt(-dt), scale


def gaussian_log_prob(x_next: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """Per-sample log N(x_next; mean, std^2), averaged over all but the batch dimension.

    ``x_next`` is a constant (the sampled state); gradients flow through ``mean``.
    """
    if x_next.shape != mean.shape:
        raise ValueError(
            f"x_next {tuple(x_next.shape)} and mean {tuple(mean.shape)} must share a shape"
        )
    if not bool((std > 0).all()):
        raise ValueError("std must be > 0: eta = 0 (the ODE step) has no density")
    x_next = x_next.detach().to(mean.dtype)
    log_density = (
        -((x_next - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    )
    return log_density.flatten(1).mean(dim=1)


def sde_sample(mean: Tensor, std: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """x_next = mean + std * N(0, I), the noise drawn on the generator's device (reproducible)."""
    device = generator.device if generator is not None else mean.device
    noise = torch.randn(mean.shape, generator=generator, device=device, dtype=mean.dtype)
    return mean.detach() + std * noise.to(mean.device)


def transition_log_prob(
    x: Tensor,
    v: Tensor,
    x_next: Tensor,
    sigma: Tensor | float,
    sigma_next: Tensor | float,
    sigma_max: float,
    eta: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """(log p(x_next | x, v), mean, sigma_t): a recorded step rescored under velocity ``v``.

    With the rollout's velocity this reproduces its log p_old; with the trained one it is
    the numerator of the importance ratio, and ``mean`` feeds Flow-GRPO's KL term.
    """
    mean, std, scale = sde_step_statistics(x, v, sigma, sigma_next, sigma_max, eta)
    return gaussian_log_prob(x_next, mean, std), mean, scale


def _per_sample(level: Tensor | float, x: Tensor, dtype: torch.dtype) -> Tensor:
    """A scalar or [B] noise level as a [B, 1, ..., 1] tensor of ``dtype``."""
    level = torch.as_tensor(level, device=x.device).to(dtype)
    if level.ndim == 0:
        level = level.expand(len(x))
    if level.shape != x.shape[:1]:
        raise ValueError(
            f"noise levels must be a scalar or shape ({len(x)},), got {tuple(level.shape)}"
        )
    return level.reshape(-1, *([1] * (x.ndim - 1)))


def _check_eta(eta: float) -> None:
    if isinstance(eta, bool) or not isinstance(eta, (int, float)) or not math.isfinite(eta):
        raise TypeError(f"eta (the SDE noise level) must be a finite number, got {eta!r}")
    if eta < 0:
        raise ValueError(f"eta (the SDE noise level) must be >= 0, got {eta}")


__all__ = [
    "gaussian_log_prob",
    "noise_scale",
    "sde_sample",
    "sde_step_statistics",
    "transition_log_prob",
]
