"""A CLIP model with its processor from a local directory: the base of five rewards.

PickScore, CLIPScore, HPSv2.1, Aesthetic and GenEval's color classifier all embed
images (and most also prompts) with a CLIP. Preprocessing is the model's own
``preprocessor_config.json`` run by transformers' PIL image processor (resize the
short side bicubic, centre crop, CLIP mean/std), as the references do through
``CLIPProcessor``; images arrive as floats in [0, 1] and are rounded to uint8 first,
as the references save or convert them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from .base import to_uint8_images
from .local_weights import TOKENIZER_FILES, WEIGHT_FILES, require_files

CLIP_FILES = ("config.json", WEIGHT_FILES, "preprocessor_config.json", TOKENIZER_FILES)


class ClipBackbone:
    """``CLIPModel`` + tokenizer + image processor, frozen, on one device.

    ``processor_path`` lets the processor come from another directory (PickScore's
    checkpoint is used with the processor of the CLIP-H it was fine-tuned from).
    """

    def __init__(
        self,
        reward: str,
        path: str | os.PathLike | None,
        how_to_get: str,
        device: str | torch.device = "cpu",
        processor_path: str | os.PathLike | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        from transformers import AutoTokenizer, CLIPImageProcessorPil, CLIPModel

        model_dir = require_files(reward, path, ("config.json", WEIGHT_FILES), how_to_get)
        processor_dir = require_files(
            reward,
            processor_path or model_dir,
            ("preprocessor_config.json", TOKENIZER_FILES),
            how_to_get,
        )
        self.model = CLIPModel.from_pretrained(model_dir, local_files_only=True, dtype=dtype)
        self.model.requires_grad_(False).eval().to(device)
        self.tokenizer = AutoTokenizer.from_pretrained(processor_dir, local_files_only=True)
        self.image_processor = CLIPImageProcessorPil.from_pretrained(
            processor_dir, local_files_only=True
        )

    @property
    def device(self) -> torch.device:
        return self.model.device

    def to(self, device: str | torch.device) -> ClipBackbone:
        self.model.to(device)
        return self

    @property
    def logit_scale(self) -> float:
        return float(self.model.logit_scale.exp())

    def pixel_values(self, images: Tensor | np.ndarray) -> Tensor:
        """Processor output for [B, 3, H, W] floats in [0, 1] or [B, H, W, 3] uint8 arrays."""
        arrays = to_uint8_images(images) if isinstance(images, Tensor) else images
        batch = self.image_processor(images=list(arrays), return_tensors="pt")
        return batch["pixel_values"].to(self.device, self.model.dtype)

    @torch.no_grad()
    def image_features(self, images: Tensor | np.ndarray, normalize: bool = True) -> Tensor:
        """Projected image embeddings [B, E] (unit length with ``normalize``), float32."""
        output = self.model.get_image_features(pixel_values=self.pixel_values(images))
        return _finish(output.pooler_output, normalize)

    @torch.no_grad()
    def text_features(self, texts: Sequence[str], normalize: bool = True) -> Tensor:
        """Projected text embeddings [B, E], truncated to the model's 77 positions."""
        tokens = self.tokenizer(
            list(texts),
            padding=True,
            truncation=True,
            max_length=self.model.config.text_config.max_position_embeddings,
            return_tensors="pt",
        ).to(self.device)
        output = self.model.get_text_features(**tokens)
        return _finish(output.pooler_output, normalize)


def _finish(features: Tensor, normalize: bool) -> Tensor:
    features = features.float()
    return features / features.norm(dim=-1, keepdim=True) if normalize else features
