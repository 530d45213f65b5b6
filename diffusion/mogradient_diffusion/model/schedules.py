"""The noise levels a sampler runs through: flow-matching schedules of the model families."""

from __future__ import annotations

import torch

# Flow-matching schedulers' training timesteps: SD3's transformer takes sigma in these units.
NUM_TRAIN_TIMESTEPS = 1000


def sampler_sigmas(
    steps: int, shift: float = 3.0, num_train_timesteps: int = NUM_TRAIN_TIMESTEPS
) -> torch.Tensor:
    """Noise levels [steps + 1] from 1 to 0, equal to ``FlowMatchEulerDiscreteScheduler``'s.

    As in diffusers: t runs linearly from 1 to the scheduler's smallest training sigma
    (itself shifted, shift(1/1000)), is shifted t' = shift t / (1 + (shift - 1) t), and a
    final 0 is appended; so the last non-zero sigma is small (0.0089 at 4 steps, shift 3).
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    n = num_train_timesteps
    sigma_min = _shift(torch.tensor(1.0) / n, shift).item()  # computed in float32, as diffusers
    t = torch.linspace(n, sigma_min * n, steps, dtype=torch.float64) / n
    sigmas = _shift(t, shift).float()
    return torch.cat([sigmas, sigmas.new_zeros(1)])


def _shift(t: torch.Tensor, shift: float) -> torch.Tensor:
    return shift * t / (1 + (shift - 1) * t)


__all__ = ["NUM_TRAIN_TIMESTEPS", "sampler_sigmas"]
