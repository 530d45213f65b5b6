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
from collections import deque
from collections.abc import Sequence
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


@dataclass(frozen=True)
class AnchorSimilarities:
    """Cosine similarities [B, T] of each step's x0 prediction to the first, anchor, last."""

    anchor: Tensor
    first: Tensor
    middle: Tensor
    last: Tensor


def anchor_similarities(predicted_x0: Tensor) -> AnchorSimilarities:
    """The anchor step and the similarities that weight the dense rewards.

    ``predicted_x0`` is [B, T, ...]. The anchor is the interior step (1 .. T - 2) whose x0
    prediction is *least* similar to the first and last ones, argmin of the summed
    cosines: the paper's eq. 10 (the reference code takes the argmin over all steps).
    """
    if predicted_x0.ndim < 3 or predicted_x0.shape[1] < 3:
        raise ValueError(
            "predicted_x0 must be [B, T, ...] with T >= 3 steps (an interior anchor), got "
            f"{tuple(predicted_x0.shape)}"
        )
    flat = predicted_x0.flatten(2).double()

    def cosine_to(step: Tensor) -> Tensor:
        return torch.cosine_similarity(flat, flat[torch.arange(len(flat)), step][:, None], dim=2)

    first = cosine_to(torch.zeros(len(flat), dtype=torch.long))
    last = cosine_to(torch.full((len(flat),), flat.shape[1] - 1, dtype=torch.long))
    anchor = (first + last)[:, 1:-1].argmin(dim=1) + 1
    return AnchorSimilarities(anchor=anchor, first=first, middle=cosine_to(anchor), last=last)


def dense_rewards(
    first: Tensor, middle: Tensor, last: Tensor, similarities: AnchorSimilarities
) -> Tensor:
    """Per-step rewards [B, T, K] from the rewards [B, K] at the first, anchor and last steps.

    R_t is the similarity-weighted mean of the three; at the three queried steps R_t is
    the queried reward itself. A reward NaN (not applicable) at any of the three queries
    is NaN at every step.
    """
    weights = torch.stack((similarities.first, similarities.middle, similarities.last), dim=2)
    shapes = {tuple(r.shape) for r in (first, middle, last)}
    if len(shapes) != 1 or first.ndim != 2 or len(first) != len(weights):
        raise ValueError(
            f"rewards must each be [B={weights.shape[0]}, K], got {tuple(first.shape)}, "
            f"{tuple(middle.shape)}, {tuple(last.shape)}"
        )
    queried = torch.stack((first, middle, last), dim=1).double()  # [B, 3, K]
    rewards = torch.einsum("btq,bqk->btk", weights, queried) / weights.sum(dim=2, keepdim=True)
    rows = torch.arange(len(rewards))
    rewards[:, 0], rewards[:, -1] = queried[:, 0], queried[:, 2]
    rewards[rows, similarities.anchor] = queried[:, 1]
    missing = torch.isnan(queried).any(dim=1)  # [B, K]
    return rewards.masked_fill(missing[:, None, :], math.nan)


def discounted_returns(rewards: Tensor, gamma: float) -> Tensor:
    """G_t = R_t + gamma G_{t+1} along dimension 1 of ``rewards`` [B, T, K]."""
    returns = rewards.clone()
    for t in range(rewards.shape[1] - 2, -1, -1):
        returns[:, t] += gamma * returns[:, t + 1]
    return returns


class StepAdvantageTracker:
    """Per-(reward, prompt, step) running statistics of the returns, kept across rollouts.

    Each update first appends the batch's returns to the buffers, then normalizes every
    return by its buffer's mean and std (population, + 1e-6), or by the whole batch's at
    that step while the buffer holds fewer than ``min_count`` values. NaN returns are
    neither stored nor normalized. Checkpoint :meth:`state_dict`: advantages after a
    resume depend on it.
    """

    def __init__(self, buffer_size: int = 32, min_count: int = 16) -> None:
        if buffer_size < 1 or not 1 <= min_count <= buffer_size:
            raise ValueError(
                f"need buffer_size >= 1 and 1 <= min_count <= buffer_size, got {buffer_size}, "
                f"{min_count}"
            )
        self.buffer_size = buffer_size
        self.min_count = min_count
        self._buffers: dict[tuple[int, str, int], deque[float]] = {}

    def update(self, prompts: Sequence[str], returns: Tensor) -> Tensor:
        """Advantages [B, T, K] (float64) of ``returns`` [B, T, K] for the rows' ``prompts``."""
        if returns.ndim != 3 or len(prompts) != returns.shape[0]:
            raise ValueError(
                f"returns must be [B={len(prompts)}, T, K] for {len(prompts)} prompts, got "
                f"{tuple(returns.shape)}"
            )
        values = returns.detach().double().cpu()
        advantages = torch.full_like(values, math.nan)
        rows_of: dict[str, list[int]] = {}
        for row, prompt in enumerate(prompts):
            rows_of.setdefault(prompt, []).append(row)
        for k in range(values.shape[2]):
            for t in range(values.shape[1]):
                column = values[:, t, k]
                present = column[~torch.isnan(column)]
                for prompt, rows in rows_of.items():
                    mine = column[rows]
                    buffer = self._buffers.setdefault(
                        (k, prompt, t), deque(maxlen=self.buffer_size)
                    )
                    buffer.extend(mine[~torch.isnan(mine)].tolist())
                    pool = torch.tensor(list(buffer), dtype=torch.float64)
                    if len(buffer) < self.min_count:
                        pool = present
                    if len(pool):
                        std = pool.std(unbiased=False) + 1e-6
                        advantages[rows, t, k] = (mine - pool.mean()) / std
        return advantages

    def state_dict(self) -> dict:
        """Plain data (JSON- and torch.save-able): settings and every buffer, oldest first."""
        return {
            "buffer_size": self.buffer_size,
            "min_count": self.min_count,
            "buffers": [[k, p, t, list(values)] for (k, p, t), values in self._buffers.items()],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (the settings must match)."""
        if (state["buffer_size"], state["min_count"]) != (self.buffer_size, self.min_count):
            raise ValueError(
                f"tracker state has buffer_size {state['buffer_size']}, min_count "
                f"{state['min_count']}; this tracker {self.buffer_size}, {self.min_count}"
            )
        self._buffers = {
            (int(k), str(p), int(t)): deque((float(v) for v in values), maxlen=self.buffer_size)
            for k, p, t, values in state["buffers"]
        }


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


def sdpo_loss(
    log_probs_a: Tensor,
    log_probs_b: Tensor,
    old_log_probs_a: Tensor,
    old_log_probs_b: Tensor,
    steps: Tensor,
    advantages_a: Tensor,
    advantages_b: Tensor,
    settings: SDPOSettings,
    valid_counts: Tensor | None = None,
) -> CombinableLoss:
    """The K per-reward SDPO losses of N (pair, step) entries.

    Log-probs are [N] (the trained ones differentiable), ``steps`` [N] the schedule index
    of each entry, advantages [N, K] (NaN where reward k does not apply; clamped here).
    Reward k's loss is the mean over its valid entries (over ``valid_counts[k]`` when
    this is one piece of an optimizer step).
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
    if (
        advantages_a.ndim != 2
        or advantages_a.shape[0] != n
        or advantages_b.shape != advantages_a.shape
    ):
        raise ValueError(
            f"advantages_a and advantages_b must be [N={n}, K], got "
            f"{tuple(advantages_a.shape)} and {tuple(advantages_b.shape)}"
        )
    if bool(torch.isinf(advantages_a).any() | torch.isinf(advantages_b).any()):
        raise ValueError("advantages contain Inf; mark a reward that does not apply with NaN")
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
    clip = settings.advantage_clip

    def clamped(a: Tensor) -> Tensor:
        return a.detach().to(device=u.device, dtype=dtype).clamp(-clip, clip).T

    delta = clamped(advantages_a) - clamped(advantages_b)  # [K, N], NaN where not applicable
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
    "AnchorSimilarities",
    "SDPOSettings",
    "StepAdvantageTracker",
    "anchor_similarities",
    "dense_rewards",
    "discounted_returns",
    "pair_log_ratio_difference",
    "sdpo_loss",
]
