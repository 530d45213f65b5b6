"""Image-prompt similarity rewards from a CLIP: PickScore, CLIPScore and HPSv2.1.

All three embed image and prompt, normalize both and take their cosine; they differ in
the checkpoint and the scale the references report:

- PickScore (Kirstain et al. 2023): CLIP-H fine-tuned on Pick-a-Pic;
  ``logit_scale.exp() * cos / 26`` as Flow-GRPO and DiffusionNFT train on it (~0.8-0.95
  for SD3.5-M images).
- CLIPScore: the cosine of OpenAI's CLIP ViT-L/14.
- HPSv2.1 (Wu et al. 2023): open_clip ViT-H-14 fine-tuned on HPD v2; the cosine. It is
  loaded in the transformers CLIP layout: ``mogradient-diffusion convert-hps`` turns the
  released open_clip checkpoint into one (same weights; ``open_clip_conversion.py``).

Flow-GRPO logs CLIPScore as ``logit_scale.exp() * cos / 30``; per-reward advantages do
not see a constant factor, so the plain cosine is kept.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from .base import Metadata, Reward
from .clip_backbone import ClipBackbone
from .registry import register_reward


class ClipSimilarity(Reward):
    """``scale * cos(image, prompt)`` with a CLIP loaded from ``path``."""

    how_to_get: str = ""

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        processor_path: str | os.PathLike | None = None,
        device: str | torch.device | None = None,
        batch_size: int | None = None,
    ):
        super().__init__(device, batch_size)
        self.clip = ClipBackbone(self.name, path, self.how_to_get, self.device, processor_path)
        scale = self.scale()
        self.value_range = (-scale, scale)

    def scale(self) -> float:
        """Multiplier of the cosine (1 for a plain cosine)."""
        return 1.0

    def to(self, device: str | torch.device) -> ClipSimilarity:
        super().to(device)
        self.clip.to(self.device)
        return self

    def score(self, images: Tensor, prompts: list[str], metadata: Metadata | None) -> Tensor:
        cosine = (self.clip.image_features(images) * self.clip.text_features(prompts)).sum(-1)
        return (self.scale() * cosine).clamp(*self.value_range).cpu()


@register_reward
class PickScore(ClipSimilarity):
    """PickScore: ``logit_scale.exp() * cos / 26`` (the references' training scale)."""

    name = "pick_score"
    aliases = ("pickscore",)
    how_to_get = (
        "Download the model `yuvalkirstain/PickScore_v1` and the processor of "
        "`laion/CLIP-ViT-H-14-laion2B-s32B-b79K` (`huggingface-cli download <id> --local-dir "
        "<dir>`) on a machine with hub access; pass the second as `processor_path`."
    )
    normalizer = 26.0

    def scale(self) -> float:
        return self.clip.logit_scale / self.normalizer


@register_reward
class ClipScore(ClipSimilarity):
    """CLIPScore: the cosine of CLIP ViT-L/14 image and prompt embeddings."""

    name = "clip_score"
    aliases = ("clipscore",)
    how_to_get = (
        "Download `openai/clip-vit-large-patch14` (`huggingface-cli download "
        "openai/clip-vit-large-patch14 --local-dir <dir>`) on a machine with hub access."
    )


@register_reward
class HpsV21(ClipSimilarity):
    """HPSv2.1: the cosine of the HPS v2.1 fine-tuned ViT-H-14, in transformers layout."""

    name = "hps_v21"
    aliases = ("hpsv21",)
    how_to_get = (
        "Download `HPS_v2.1_compressed.pt` (the HPSv2 release) and the open_clip tokenizer "
        "/processor of `laion/CLIP-ViT-H-14-laion2B-s32B-b79K`, then run "
        "`mogradient-diffusion convert-hps HPS_v2.1_compressed.pt <processor dir> <out dir>`."
    )
