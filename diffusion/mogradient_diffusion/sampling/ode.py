"""The deterministic steps of the flow ODE: Euler and multistep DPM-Solver++(2M).

Flow matching convention: x_t = (1 - t) x0 + t noise, velocity v = noise - x0; a step
goes from noise level ``sigma`` down to ``sigma_next`` (Python floats of the schedule).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def euler_step(x: Tensor, v: Tensor, sigma: float, sigma_next: float) -> Tensor:
    """x + (sigma_next - sigma) v; dt is rounded to float32 as the diffusers scheduler does."""
    dt = (torch.tensor(sigma_next) - torch.tensor(sigma)).item()
    return x + dt * v


def dpm2_step(
    x: Tensor, v: Tensor, levels: list[float], i: int, previous_x0: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Step ``i`` of multistep DPM-Solver++(2M) in data prediction with alpha = 1 - sigma:
    x_next and this step's x0 prediction (the next step's ``previous_x0``).

    The rule is the reference's (DiffusionNFT's ``flow_grpo/diffusers_patch/solver.py``,
    ``dpm_step`` with order 2, which MARBLE's rollouts use): step 0 and the last step are
    first order (a DDIM update, exactly Euler here); every other step is second order,
    x_next = Euler + (1 - sigma_next / sigma) / 2 * (h / h_previous) * (x0 - previous_x0),
    h the log-SNR increment. At step 1 from sigma = 1 (log-SNR -inf) the reference's
    correction is exactly 0, so the step is computed as Euler. The reference's extra rule
    for fewer than 15 steps (``lower_order_second``) only chooses second over third order:
    for order 2 it changes nothing, and no step count makes another step first order.
    """
    sigma, sigma_next = levels[i], levels[i + 1]
    x0 = x - sigma * v
    x_next = euler_step(x, v, sigma, sigma_next)
    last = i == len(levels) - 2
    if previous_x0 is not None and not last and sigma_next > 0 and levels[i - 1] < 1:
        h = _log_snr(sigma_next) - _log_snr(sigma)
        h_previous = _log_snr(sigma) - _log_snr(levels[i - 1])
        x_next = x_next + 0.5 * (1 - sigma_next / sigma) * (h / h_previous) * (x0 - previous_x0)
    return x_next, x0


def _log_snr(sigma: float) -> float:
    return math.log((1 - sigma) / sigma)


__all__ = ["dpm2_step", "euler_step"]
