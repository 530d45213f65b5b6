"""A rule-based counting check for flat-background images: blobs versus the prompt's number.

The background color is the median of the border pixels; pixels differing from it by
more than ``tolerance`` (max over channels, in [0, 1] units) are foreground; its
4-connected components of at least ``min_area`` (share of the pixels) are the
objects. Score ``max(0, 1 - |found - asked| / asked)``: graded, so a policy gets signal
before it counts exactly. NaN unless the prompt holds exactly one number (one..ten or
1..10). Honest only where objects sit apart on a plain background (synthetic scenes,
the tiny pipeline's toy task): it counts every object, not only the named class.
"""

from __future__ import annotations

import re

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from .base import Metadata, Reward, score_each_image
from .registry import register_reward

_NUMBER_WORDS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
_NUMBER = re.compile(r"\b(" + "|".join(_NUMBER_WORDS) + r"|10|[1-9])\b", re.IGNORECASE)
# Component labelling cost grows with the pixel count; objects that matter survive 128 px.
_MAX_SIDE = 128


def count_in_prompt(prompt: str) -> int | None:
    """The one number the prompt asks for; None with no number or several."""
    numbers = [m.group(1).lower() for m in _NUMBER.finditer(prompt)]
    if len(numbers) != 1:
        return None
    word = numbers[0]
    return int(word) if word.isdigit() else _NUMBER_WORDS.index(word) + 1


def count_objects(image: np.ndarray, tolerance: float = 0.15, min_area: float = 0.002) -> int:
    """Number of foreground components of one [H, W, 3] uint8 image (see module doc)."""
    pil = Image.fromarray(image)
    if max(pil.size) > _MAX_SIDE:
        scale = _MAX_SIDE / max(pil.size)
        size = (max(1, round(pil.width * scale)), max(1, round(pil.height * scale)))
        pil = pil.resize(size, Image.Resampling.BOX)
    x = np.asarray(pil, dtype=np.float32) / 255
    border = np.concatenate([x[0], x[-1], x[:, 0], x[:, -1]])
    foreground = np.abs(x - np.median(border, axis=0)).max(-1) > tolerance
    labels = _component_labels(foreground)
    _, sizes = np.unique(labels[foreground], return_counts=True)
    return int((sizes >= min_area * foreground.size).sum())


def _component_labels(mask: np.ndarray) -> np.ndarray:
    """4-connected component labels of a boolean mask (background: -1), vectorized.

    Every foreground pixel starts with its own index; repeated neighbour-minimum passes
    plus pointer jumping converge to the smallest index in each component.
    """
    height, width = mask.shape
    background = height * width
    labels = np.where(mask, np.arange(background).reshape(height, width), background)
    while True:
        previous = labels
        padded = np.pad(labels, 1, constant_values=background)
        neighbours = np.minimum.reduce(
            [padded[:-2, 1:-1], padded[2:, 1:-1], padded[1:-1, :-2], padded[1:-1, 2:], labels]
        )
        labels = np.where(mask, neighbours, background)
        flat = np.append(labels.ravel(), background)
        labels = np.where(mask, flat[labels], background)
        if np.array_equal(labels, previous):
            return np.where(mask, labels, -1)


@register_reward
class CountMatch(Reward):
    """Objects counted on a plain background versus the number in the prompt."""

    name = "count_match"
    value_range = (0.0, 1.0)

    def __init__(
        self,
        tolerance: float = 0.15,
        min_area: float = 0.002,
        device: str | torch.device | None = None,
        batch_size: int | None = None,
    ):
        super().__init__(device, batch_size)
        if not 0 < tolerance < 1 or not 0 <= min_area < 1:
            raise ValueError(
                f"need 0 < tolerance < 1 and 0 <= min_area < 1, got {tolerance}, {min_area}"
            )
        self.tolerance = tolerance
        self.min_area = min_area

    def score(self, images: Tensor, prompts: list[str], metadata: Metadata | None) -> Tensor:
        asked = [count_in_prompt(p) for p in prompts]
        todo = [i for i, n in enumerate(asked) if n is not None]

        def score_one(i: int, image: np.ndarray) -> float:
            found = count_objects(image, self.tolerance, self.min_area)
            return max(0.0, 1.0 - abs(found - asked[i]) / asked[i])

        return score_each_image(images, len(prompts), todo, score_one)
