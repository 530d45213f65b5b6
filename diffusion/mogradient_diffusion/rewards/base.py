"""The reward interface: images in [0, 1] and prompts in, one float per image out.

A reward that does not apply to a sample (an OCR reward on a prompt without quoted
text, a color check on a prompt naming no color) returns NaN there; advantages and
the weighted-sum baseline ignore NaN entries. Validation lives in ``Reward.__call__``
so every reward, built-in or user-written, is checked the same way: a bug surfaces as
an error naming the reward, never as a silent zero.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

Metadata = Sequence[Mapping[str, Any]]

# Decoders overshoot [0, 1] by rounding error; anything further out is a caller bug
# (most often images still in [-1, 1]).
_INPUT_TOLERANCE = 1e-3


class RewardError(RuntimeError):
    """A reward raised or returned invalid scores; the message names the reward."""


class RewardTimeout(RewardError):
    """A reward did not finish one batch within its timeout: it hangs, or is far too slow."""


class Reward(ABC):
    """Base class: subclasses set ``name`` and ``value_range`` and implement ``score``.

    ``device`` is where a model-based reward keeps its model; rule-based rewards run on
    the CPU whatever it says. Left at ``None`` the reward follows the training device
    (``RewardSet.to``); set, it is pinned there, e.g. a reward model on a second GPU.
    ``batch_size`` caps how many images one ``score`` call sees (``None``: the whole
    batch), to bound the memory of model-based rewards.
    """

    name: str  # the registered name; make_reward gives an instance the name a config used
    aliases: tuple[str, ...] = ()  # old spellings of ``name`` that configs may still use
    value_range: tuple[float, float]
    # True for a reward that waits on something outside this process (a server) and may be
    # called from several threads at once: a reward set scores it beside the other rewards
    # and, with rollout.overlap_rewards, on several batches at once. False (models and rules
    # in this process): scored one at a time, in the listed order.
    concurrent: bool = False

    def __init__(self, device: str | torch.device | None = None, batch_size: int | None = None):
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"{self.name}: batch_size must be >= 1 or None, got {batch_size}")
        self.pinned_device = device is not None
        self.device = torch.device("cpu" if device is None else device)
        self.batch_size = batch_size

    def to(self, device: str | torch.device) -> Reward:
        """Move the reward (and any model it holds) to ``device``; returns self."""
        self.device = torch.device(device)
        return self

    def take_failed_samples(self) -> int | None:
        """Samples scored NaN since the last call because scoring them failed (not because
        the reward does not apply), reset to 0; None for a reward that raises instead."""
        return None

    def close(self) -> None:
        """Release what the reward holds beyond memory (connections, threads) once a run or
        an evaluation is done with it; it is not called again after. Default: nothing."""
        return None

    @abstractmethod
    def score(self, images: Tensor, prompts: list[str], metadata: Metadata | None) -> Tensor:
        """Scores of one chunk: ``images`` [b, 3, H, W] in [0, 1] -> [b] (NaN: n/a)."""

    def __call__(
        self, images: Tensor, prompts: Sequence[str], metadata: Metadata | None = None
    ) -> Tensor:
        """Score a batch; returns a CPU float32 tensor [B] with NaN where not applicable.

        ``metadata`` (one mapping per image, e.g. GenEval's ``include``/``exclude``) is
        passed through for rewards that need more than the prompt.
        """
        prompts = list(prompts)
        self._check_inputs(images, prompts, metadata)
        step = self.batch_size or len(prompts) or 1
        chunks = [
            self.score(
                images[i : i + step],
                prompts[i : i + step],
                None if metadata is None else metadata[i : i + step],
            )
            for i in range(0, len(prompts), step)
        ]
        scores = torch.cat(chunks) if chunks else torch.empty(0)
        return self._checked_output(scores, len(prompts))

    def _check_inputs(self, images: Tensor, prompts: list[str], metadata: Metadata | None) -> None:
        if not isinstance(images, Tensor) or images.ndim != 4 or images.shape[1] != 3:
            shape = tuple(images.shape) if isinstance(images, Tensor) else type(images).__name__
            raise ValueError(f"{self.name}: images must be a [B, 3, H, W] tensor, got {shape}")
        if images.shape[0] != len(prompts):
            raise ValueError(f"{self.name}: {images.shape[0]} images but {len(prompts)} prompts")
        if metadata is not None and len(metadata) != len(prompts):
            raise ValueError(f"{self.name}: {len(metadata)} metadata but {len(prompts)} prompts")
        if not images.is_floating_point():
            raise ValueError(f"{self.name}: images must be floating point in [0, 1]")
        if images.numel():
            low, high = images.min().item(), images.max().item()
            if not (low >= -_INPUT_TOLERANCE and high <= 1 + _INPUT_TOLERANCE):
                raise ValueError(
                    f"{self.name}: images must lie in [0, 1], got [{low:.3g}, {high:.3g}]"
                )

    def _checked_output(self, scores: Tensor, batch: int) -> Tensor:
        scores = torch.as_tensor(scores).detach().to("cpu", torch.float32)
        if scores.shape != (batch,):
            raise RewardError(
                f"{self.name}: expected scores of shape ({batch},), got {tuple(scores.shape)}"
            )
        low, high = self.value_range
        present = scores[~torch.isnan(scores)]
        bad = present[~torch.isfinite(present) | (present < low) | (present > high)]
        if bad.numel():
            raise RewardError(
                f"{self.name}: scores {bad[:5].tolist()} outside the declared range [{low}, {high}]"
            )
        return scores


def to_uint8_images(images: Tensor) -> np.ndarray:
    """[B, 3, H, W] floats in [0, 1] -> [B, H, W, 3] uint8, rounded like the references."""
    return (
        (images.detach().float() * 255)
        .round()
        .clamp(0, 255)
        .to(torch.uint8)
        .permute(0, 2, 3, 1)
        .cpu()
        .numpy()
    )


def nan_scores(batch: int) -> Tensor:
    """A float32 tensor of NaN: the score of samples a reward does not apply to."""
    return torch.full((batch,), math.nan, dtype=torch.float32)


def score_each_image(
    images: Tensor,
    batch: int,
    todo: Sequence[int],
    score_one: Callable[[int, np.ndarray], float],
) -> Tensor:
    """Scores of ``batch`` samples: NaN but at the indices ``todo``, where sample ``i``
    scores ``score_one(i, image)`` on its [H, W, 3] uint8 image (converted all at once)."""
    scores = nan_scores(batch)
    if todo:
        for i, image in zip(todo, to_uint8_images(images[list(todo)]), strict=True):
            scores[i] = score_one(i, image)
    return scores
