"""SDPO's dense step-level advantages: three reward queries spread over every step.

Rewards are queried on the predicted clean samples x0_hat_t = x_t - t v at the first
step, an anchor step and the last step. The anchor is the interior step whose prediction
is least similar (summed cosine) to the first and last ones; every step's reward is the
mean of the three queried rewards weighted by its prediction's cosine similarity to
theirs. Discounted returns are normalized per (reward, prompt, step) by statistics kept
across rollouts (so they belong in checkpoints).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


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
    neither stored nor normalized. Checkpoint
    [`state_dict`][mogradient_diffusion.objectives.sdpo_advantages.StepAdvantageTracker.state_dict]:
    advantages after a resume depend on it.
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
        """Restore what
        [`state_dict`][mogradient_diffusion.objectives.sdpo_advantages.StepAdvantageTracker.state_dict]
        returned (the settings must match)."""
        if (state["buffer_size"], state["min_count"]) != (self.buffer_size, self.min_count):
            raise ValueError(
                f"tracker state has buffer_size {state['buffer_size']}, min_count "
                f"{state['min_count']}; this tracker {self.buffer_size}, {self.min_count}"
            )
        self._buffers = {
            (int(k), str(p), int(t)): deque((float(v) for v in values), maxlen=self.buffer_size)
            for k, p, t, values in state["buffers"]
        }


__all__ = [
    "AnchorSimilarities",
    "StepAdvantageTracker",
    "anchor_similarities",
    "dense_rewards",
    "discounted_returns",
]
