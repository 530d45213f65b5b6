"""JPEG file size as a reward (DDPO): a cheap, model-free proxy for image complexity.

Scale: the size in kB (1000 bytes) of the image saved as JPEG at quality 95, as DDPO
and Flow-GRPO compute it; a 512 x 512 SD image is typically tens to a few hundred kB,
and the size grows with the pixel count. Flow-GRPO additionally divides the
compressibility reward by 500; per-reward advantages are scale-free, so only a
weighted-sum baseline would notice, and its weights can absorb the factor.
"""

from __future__ import annotations

import io
import math

import torch
from PIL import Image
from torch import Tensor

from .base import Metadata, Reward, to_uint8_images
from .registry import register_reward


def jpeg_kilobytes(images: Tensor, quality: int = 95) -> Tensor:
    """Size in kB of each [3, H, W] image in [0, 1] saved as JPEG at ``quality``."""
    sizes = []
    for array in to_uint8_images(images):
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000)
    return torch.tensor(sizes, dtype=torch.float32)


@register_reward
class JpegIncompressibility(Reward):
    """JPEG size in kB: rewards detail and texture. Range [0, inf): it grows with H x W."""

    name = "jpeg_incompressibility"
    value_range = (0.0, math.inf)
    sign = 1.0

    def __init__(
        self,
        quality: int = 95,
        device: str | torch.device | None = None,
        batch_size: int | None = None,
    ):
        super().__init__(device, batch_size)
        if not 1 <= quality <= 100:
            raise ValueError(f"JPEG quality must be in 1..100, got {quality}")
        self.quality = quality

    def score(self, images: Tensor, prompts: list[str], metadata: Metadata | None) -> Tensor:
        return self.sign * jpeg_kilobytes(images, self.quality)


@register_reward
class JpegCompressibility(JpegIncompressibility):
    """Minus the JPEG size in kB: rewards smooth, simple images. Range (-inf, 0]."""

    name = "jpeg_compressibility"
    value_range = (-math.inf, 0.0)
    sign = -1.0
