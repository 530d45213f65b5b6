"""Score one batch with K rewards: the B x K matrix that per-reward advantages start from."""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from .base import Metadata, Reward, RewardError


class RewardScores(NamedTuple):
    """``values[b, k]``: reward k of image b (NaN: not applicable); seconds per reward.

    A tuple, so ``values, seconds = reward_set(images, prompts)`` works.
    """

    values: Tensor
    seconds: dict[str, float]


class RewardSet:
    """K rewards applied in order; any failure stops the batch with the reward named."""

    def __init__(self, rewards: Sequence[Reward]):
        names = [reward.name for reward in rewards]
        if not names:
            raise ValueError("RewardSet needs at least one reward")
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate reward names: {duplicates}")
        self.rewards = tuple(rewards)
        self.names = tuple(names)

    def __len__(self) -> int:
        return len(self.rewards)

    def to(self, device: str | torch.device) -> RewardSet:
        """Move every reward not pinned to a device of its own to ``device``; returns self."""
        for reward in self.rewards:
            if not reward.pinned_device:
                reward.to(device)
        return self

    def __call__(
        self, images: Tensor, prompts: Sequence[str], metadata: Metadata | None = None
    ) -> RewardScores:
        """Score ``images`` [B, 3, H, W] in [0, 1] with every reward -> [B, K] float32.

        Each reward gets its own copy of the images, prompts and metadata: one that edits
        its inputs in place must not change what the rewards after it score.
        """
        columns, seconds = [], {}
        for reward in self.rewards:
            start = time.perf_counter()
            inputs = (images.clone(), list(prompts), copy.deepcopy(metadata))
            try:
                columns.append(reward(*inputs))
            except RewardError:
                raise
            except Exception as exc:
                raise RewardError(f"reward {reward.name!r} failed: {exc}") from exc
            except SystemExit as exc:  # a reward must not end training silently
                raise RewardError(
                    f"reward {reward.name!r} called sys.exit({exc.code!r}) while scoring"
                ) from exc
            seconds[reward.name] = time.perf_counter() - start
        return RewardScores(torch.stack(columns, dim=1), seconds)
