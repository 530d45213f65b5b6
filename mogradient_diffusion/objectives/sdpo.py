"""SDPO: step-level reward differences between pairs, as a CombinableLoss per reward.

Two trajectories a, b of one prompt share x_T and draw their own per-step noise. Rewards
are queried on the predicted clean samples at three steps (first, an anchor, last) and
spread to every step by cosine similarity of the x0 predictions; discounted returns are
normalized per (prompt, step) by a persistent tracker. At step t the pair's loss is

    max((u - dA)^2, (u_clip - dA)^2),   u = lambda^t / scale * (rho_a - rho_b),

rho = log p_theta - log p_old (u_clip with rho clipped to +-eps), dA = A_a - A_b with
clamped advantages. Expanding the active square gives shared terms [u^2, u, u_clip^2,
u_clip, 1] and per-reward constants [s, -2 dA s, 1 - s, -2 dA (1 - s), dA^2] / n, where s
marks the active branch (1/2 on ties, as the max's gradient splits): exact for every
reward and every weighted sum of them. The constant term makes the loss values, not only
the gradients, equal the reference's. The shared u grad(u) part makes per-reward
gradients more alike as rho grows, which inflates their cosines.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from mogradient.objectives import CombinableLoss, masked_mean_coefficients


@dataclass(frozen=True)
class SDPOSettings:
    """SDPO's objective; defaults are the reference's, except the sampler.

    noise_level: eta of the flow SDE (0.7, Flow-GRPO's; the reference's DDIM eta = 1 is
        another parameterization).
    clip_range: rho is clipped to +-this in u_clip (1e-4).
    gamma: discount of the returns (0.99).
    step_decay: lambda, the weight lambda^t of step t (t = 0 the noisiest) (0.99).
    log_ratio_scale: the paper's eta dividing the log-ratio difference (1).
    advantage_clip: advantages are clamped to +-this before the difference (5).
    buffer_size, min_count: the tracker keeps the last ``buffer_size`` returns per
        (reward, prompt, step) and uses batch statistics below ``min_count`` (32, 16).
    """

    noise_level: float = 0.7
    clip_range: float = 1e-4
    gamma: float = 0.99
    step_decay: float = 0.99
    log_ratio_scale: float = 1.0
    advantage_clip: float = 5.0
    buffer_size: int = 32
    min_count: int = 16

    def __post_init__(self) -> None:
        for name in ("noise_level", "clip_range", "log_ratio_scale", "advantage_clip"):
            _check_real(name, getattr(self, name), low=0.0, open_low=True)
        for name in ("gamma", "step_decay"):
            _check_real(name, getattr(self, name), low=0.0, high=1.0)
        for name in ("buffer_size", "min_count"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.min_count > self.buffer_size:
            raise ValueError(
                f"min_count {self.min_count} exceeds buffer_size {self.buffer_size}: the "
                "tracker would never use its own statistics"
            )


def pair_log_ratio_difference(
    log_probs_a: Tensor,
    log_probs_b: Tensor,
    old_log_probs_a: Tensor,
    old_log_probs_b: Tensor,
    step_weights: Tensor,
    clip_range: float,
) -> tuple[Tensor, Tensor]:
    """(u, u_clip) [N]: the weighted log-ratio difference, unclipped and with rho in +-eps."""
    rho_a = log_probs_a - old_log_probs_a.detach()
    rho_b = log_probs_b - old_log_probs_b.detach()
    weight = step_weights.detach().to(rho_a.dtype)
    u = weight * (rho_a - rho_b)
    u_clip = weight * (rho_a.clamp(-clip_range, clip_range) - rho_b.clamp(-clip_range, clip_range))
    return u, u_clip


def advantage_differences(advantages_a: Tensor, advantages_b: Tensor, clip: float) -> Tensor:
    """dA = clamp(A_a) - clamp(A_b), elementwise; NaN where either side does not apply."""
    if advantages_a.shape != advantages_b.shape:
        raise ValueError(
            f"advantages_a {tuple(advantages_a.shape)} and advantages_b "
            f"{tuple(advantages_b.shape)} must share a shape"
        )
    if bool(torch.isinf(advantages_a).any() | torch.isinf(advantages_b).any()):
        raise ValueError("advantages contain Inf; mark a reward that does not apply with NaN")
    return advantages_a.clamp(-clip, clip) - advantages_b.clamp(-clip, clip)


def sdpo_loss(
    log_probs_a: Tensor,
    log_probs_b: Tensor,
    old_log_probs_a: Tensor,
    old_log_probs_b: Tensor,
    steps: Tensor,
    differences: Tensor,
    settings: SDPOSettings,
    valid_counts: Tensor | None = None,
) -> CombinableLoss:
    """The K per-reward SDPO losses of N (pair, step) entries.

    Log-probs are [N] (the trained ones differentiable), ``steps`` [N] the schedule index
    of each entry, ``differences`` [N, K] the pairs' :func:`advantage_differences` (NaN
    where reward k does not apply). Reward k's loss is the mean over its valid entries
    (over ``valid_counts[k]`` when this is one piece of an optimizer step).
    """
    n = len(log_probs_a)
    for name, tensor in (
        ("log_probs_b", log_probs_b),
        ("old_log_probs_a", old_log_probs_a),
        ("old_log_probs_b", old_log_probs_b),
        ("steps", steps),
    ):
        if log_probs_a.ndim != 1 or tensor.shape != (n,):
            raise ValueError(f"log_probs_a and {name} must be [N], got {tuple(tensor.shape)}")
    if differences.ndim != 2 or differences.shape[0] != n:
        raise ValueError(f"differences must be [N={n}, K], got {tuple(differences.shape)}")
    if bool(torch.isinf(differences).any()):
        raise ValueError("differences contain Inf; mark a reward that does not apply with NaN")
    dtype = torch.promote_types(log_probs_a.dtype, torch.float32)
    step_weights = settings.step_decay ** steps.to(dtype) / settings.log_ratio_scale
    u, u_clip = pair_log_ratio_difference(
        log_probs_a.to(dtype),
        log_probs_b.to(dtype),
        old_log_probs_a.to(dtype),
        old_log_probs_b.to(dtype),
        step_weights.to(log_probs_a.device),
        settings.clip_range,
    )
    delta = differences.detach().to(device=u.device, dtype=dtype).T  # [K, N]
    unclipped = (u.detach() - delta) ** 2
    clipped = (u_clip.detach() - delta) ** 2
    s = torch.where(unclipped > clipped, 1.0, torch.where(unclipped < clipped, 0.0, 0.5))
    per_sample = torch.stack((s, -2 * delta * s, 1 - s, -2 * delta * (1 - s), delta**2), dim=1).to(
        dtype
    )
    coefficients = masked_mean_coefficients(per_sample, ~torch.isnan(delta), valid_counts)
    terms = torch.stack((u**2, u, u_clip**2, u_clip, torch.ones_like(u)))
    return CombinableLoss(terms=terms, coefficients=coefficients)


def _check_real(
    name: str,
    value: float,
    low: float | None = None,
    high: float | None = None,
    open_low: bool = False,
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{name} must be a finite number, got {value!r}")
    if low is not None and (value < low or (open_low and value == low)):
        raise ValueError(f"{name} must be {'>' if open_low else '>='} {low}, got {value!r}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value!r}")


__all__ = [
    "SDPOSettings",
    "advantage_differences",
    "pair_log_ratio_difference",
    "sdpo_loss",
]
