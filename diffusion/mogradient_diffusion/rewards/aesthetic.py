"""LAION aesthetic predictor v2: an MLP on CLIP ViT-L/14 image embeddings, ~1-10 scale.

The head (``sac+logos+ava1-l14-linearMSE.pth``) is five linear layers
768-1024-128-64-16-1 with dropout between the first four (inactive at inference) and
no activations, applied to the L2-normalized image embedding; the references score with
it unchanged, so a typical SD image lands around 5-6.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
from torch import Tensor, nn

from .base import Metadata, Reward
from .clip_backbone import ClipBackbone
from .local_weights import MissingWeightsError
from .registry import register_reward

HOW_TO_GET = (
    "Download `openai/clip-vit-large-patch14` (`huggingface-cli download "
    "openai/clip-vit-large-patch14 --local-dir <dir>`) and the head "
    "`sac+logos+ava1-l14-linearMSE.pth` from the LAION improved-aesthetic-predictor "
    "release; pass the head file as `head`."
)
HEAD_WIDTHS = (1024, 128, 64, 16, 1)
HEAD_DROPOUT = (0.2, 0.2, 0.1, 0.0)


def aesthetic_head(embedding_dim: int = 768) -> nn.Sequential:
    """The predictor's layer stack; indices match the released state dict (``layers.N``)."""
    layers: list[nn.Module] = []
    width = embedding_dim
    for i, out in enumerate(HEAD_WIDTHS):
        layers.append(nn.Linear(width, out))
        if i < len(HEAD_DROPOUT) and HEAD_DROPOUT[i] > 0:
            layers.append(nn.Dropout(HEAD_DROPOUT[i]))
        width = out
    return nn.Sequential(*layers)


def load_aesthetic_head(path: str | os.PathLike, embedding_dim: int) -> nn.Sequential:
    """Read the head from a ``.pth`` (torch state dict) or ``.safetensors`` file."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise MissingWeightsError(
            f"reward 'aesthetic': head file {str(path)!r} not found. {HOW_TO_GET}"
        )
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(path)
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    state = {key.removeprefix("layers."): value for key, value in state.items()}
    head = aesthetic_head(embedding_dim)
    head.load_state_dict(state)
    return head.requires_grad_(False).eval()


@register_reward
class Aesthetic(Reward):
    """LAION aesthetic score of the image (the prompt is not used)."""

    name = "aesthetic"
    value_range = (-math.inf, math.inf)

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        head: str | os.PathLike | None = None,
        device: str | torch.device | None = None,
        batch_size: int | None = None,
    ):
        super().__init__(device, batch_size)
        self.clip = ClipBackbone(self.name, path, HOW_TO_GET, self.device)
        if head is None:
            raise MissingWeightsError(f"reward 'aesthetic' needs the option `head`. {HOW_TO_GET}")
        dim = self.clip.model.config.projection_dim
        self.head = load_aesthetic_head(head, dim).to(self.device)

    def to(self, device: str | torch.device) -> Aesthetic:
        super().to(device)
        self.clip.to(self.device)
        self.head.to(self.device)
        return self

    @torch.no_grad()
    def score(self, images: Tensor, prompts: list[str], metadata: Metadata | None) -> Tensor:
        return self.head(self.clip.image_features(images)).squeeze(-1).cpu()
