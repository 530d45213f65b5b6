"""A rule-based compositional check: are the colors the prompt names in the image?

Each pixel gets one of eleven color names by hand-set HSV rules (below); a color
named in the prompt counts as present when at least ``min_share`` of the pixels carry
it. The score is the fraction of named colors present, NaN when the prompt names
none. It needs no model and works on 64 px images, which makes it a real reward for
the tiny pipeline and for synthetic tests. It is not GenEval: it does not tie a color
to an object, a white or black background counts as that color, and "an orange" (the
fruit) asks for orange pixels.
"""

from __future__ import annotations

import re

import numpy as np
import torch
from torch import Tensor

from .base import Metadata, Reward, score_each_image
from .registry import register_reward

COLORS = (
    "red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white",
    "gray",
)  # fmt: skip
_INDEX = {name: i for i, name in enumerate(COLORS)}
_SYNONYMS = {"grey": "gray"}
_COLOR_WORD = re.compile(r"\b(" + "|".join(COLORS + tuple(_SYNONYMS)) + r")\b", re.IGNORECASE)

# Hue sectors: (exclusive upper end in degrees, name); the achromatic rules override them.
_HUE_SECTORS = ((15, "red"), (45, "orange"), (70, "yellow"), (165, "green"), (255, "blue"),
                (295, "purple"), (345, "pink"), (360, "red"))  # fmt: skip


def colors_in_prompt(prompt: str) -> list[str]:
    """Color names the prompt mentions, in order of first mention ("grey" -> "gray")."""
    found = (m.group(1).lower() for m in _COLOR_WORD.finditer(prompt))
    return list(dict.fromkeys(_SYNONYMS.get(word, word) for word in found))


def classify_pixels(rgb: np.ndarray) -> np.ndarray:
    """Index into ``COLORS`` of each pixel of a [..., 3] uint8 array.

    Dark (value < 0.2) is black; low chroma is white (value > 0.85) or gray; else the
    hue sector decides, refined so that light, desaturated reds are pink, dark or
    desaturated oranges brown, and dark magentas purple (bright ones stay pink).
    """
    x = rgb.astype(np.float32) / 255
    value, low = x.max(-1), x.min(-1)
    chroma = value - low
    saturation = np.where(value > 0, chroma / np.maximum(value, 1e-6), 0)
    hue = _hue_degrees(x, value, chroma)
    sector = np.searchsorted(np.array([end for end, _ in _HUE_SECTORS]), hue, side="right")
    names = np.array([_INDEX[name] for _, name in _HUE_SECTORS])
    labels = names[np.minimum(sector, len(names) - 1)]
    reddish = labels == _INDEX["red"]
    labels = np.where(reddish & (saturation < 0.5) & (value > 0.7), _INDEX["pink"], labels)
    orange = labels == _INDEX["orange"]
    labels = np.where(orange & ((value < 0.65) | (saturation < 0.5)), _INDEX["brown"], labels)
    magenta = (hue >= 295) & (hue < 345)
    labels = np.where(magenta & (value < 0.7), _INDEX["purple"], labels)
    achromatic = (chroma < 0.1) | (saturation < 0.15)
    labels = np.where(achromatic, np.where(value > 0.85, _INDEX["white"], _INDEX["gray"]), labels)
    return np.where(value < 0.2, _INDEX["black"], labels)


def _hue_degrees(x: np.ndarray, value: np.ndarray, chroma: np.ndarray) -> np.ndarray:
    r, g, b = x[..., 0], x[..., 1], x[..., 2]
    safe = np.maximum(chroma, 1e-6)
    hue = np.where(
        value == r,
        ((g - b) / safe) % 6,
        np.where(value == g, (b - r) / safe + 2, (r - g) / safe + 4),
    )
    return hue * 60


def color_shares(image: np.ndarray) -> np.ndarray:
    """Share of the pixels of one [H, W, 3] uint8 image per entry of ``COLORS``."""
    counts = np.bincount(classify_pixels(image).ravel(), minlength=len(COLORS))
    return counts / counts.sum()


@register_reward
class ColorMatch(Reward):
    """Fraction of the prompt's color words whose color covers >= ``min_share`` of pixels.

    ``graded``: each color word scores ``min(share / min_share, 1)`` instead of 0 or 1, so
    images whose colors all sit on one side of the threshold still differ (an untrained
    model's images do: every one holds about the same share of each color).
    """

    name = "color_match"
    value_range = (0.0, 1.0)

    def __init__(
        self,
        min_share: float = 0.03,
        graded: bool = False,
        device: str | torch.device | None = None,
        batch_size: int | None = None,
    ):
        super().__init__(device, batch_size)
        if not 0 < min_share <= 1:
            raise ValueError(f"min_share must be in (0, 1], got {min_share}")
        if not isinstance(graded, bool):
            raise ValueError(f"graded must be true or false, got {graded!r}")
        self.min_share = min_share
        self.graded = graded

    def score(self, images: Tensor, prompts: list[str], metadata: Metadata | None) -> Tensor:
        wanted = [colors_in_prompt(p) for p in prompts]
        todo = [i for i, names in enumerate(wanted) if names]

        def score_one(i: int, image: np.ndarray) -> float:
            shares = color_shares(image)[[_INDEX[name] for name in wanted[i]]]
            if self.graded:
                return float(np.minimum(shares / self.min_share, 1.0).mean())
            return float((shares >= self.min_share).mean())

        return score_each_image(images, len(prompts), todo, score_one)
