"""Learned scorers of the miniature world: the analogues of the paper's learned rewards.

The paper mixes rule-based rewards with learned ones (PickScore/HPS for preference,
CLIPScore for alignment, Aesthetic/ImageReward kept for evaluation only). Here each
learned reward is a small network trained on the world's own renders, so the whole
reward mix runs offline on a CPU:

- ``mini_preference``: image quality in [0, 1] (sigmoid output of a CNN regressor trained
  to predict the quality of degraded renders; the prompt is not used);
- ``mini_preference_heldout``: an independently trained second quality scorer (other
  seed, architecture and degradation weighting), for evaluation only, so a policy
  optimised against ``mini_preference`` is judged by a scorer it never saw;
- ``mini_alignment``: cosine in [-1, 1] between a CNN image embedding and a GRU prompt
  embedding trained contrastively (InfoNCE).

Checkpoints (``<name>.safetensors`` + ``<name>.json``) ship in ``mini/weights/`` and are
made by ``python -m miniature.train_scorers --out
miniature/weights``; the option ``path`` points a reward at another
directory written by that script.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mogradient_diffusion.rewards.base import Metadata, Reward
from mogradient_diffusion.rewards.local_weights import require_files
from mogradient_diffusion.rewards.registry import register_reward

IMAGE_SIZE = 64
WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
TRAIN_COMMAND = "python -m miniature.train_scorers --out <dir>"
HOW_TO_GET = (
    f"Train the mini scorers with `{TRAIN_COMMAND}` (the shipped checkpoints live in "
    "miniature/weights/) and pass that directory as the option `path`."
)
PAD, UNKNOWN = 0, 1  # token ids reserved before the vocabulary


# --- networks ------------------------------------------------------------------------------


def _conv_stack(
    in_channels: int, widths: list[int], first_kernel: int, downsample: str
) -> nn.Sequential:
    """Conv-ReLU layers, halving the resolution before every layer but the first.

    The first layer runs at full resolution: noise, blur and blockiness live in the
    finest pixels, and text strokes are 1-2 px wide at 64 px.
    """
    if downsample not in ("pool", "stride"):
        raise ValueError(f"downsample must be 'pool' or 'stride', got {downsample!r}")
    layers: list[nn.Module] = []
    channels = in_channels
    for i, width in enumerate(widths):
        kernel = first_kernel if i == 0 else 3
        stride = 2 if downsample == "stride" and i > 0 else 1
        if downsample == "pool" and i > 0:
            layers.append(nn.AvgPool2d(2))
        layers += [nn.Conv2d(channels, width, kernel, stride, kernel // 2), nn.ReLU()]
        channels = width
    return nn.Sequential(*layers)


def _global_pool(features: Tensor, mode: str) -> Tensor:
    """[b, c, h, w] -> [b, 2c]: the mean plus a spread (std) or peak (max) statistic."""
    flat = features.flatten(2)
    if mode == "mean_std":
        second = flat.var(-1, unbiased=False).add(1e-6).sqrt()
    elif mode == "mean_max":
        second = flat.amax(-1)
    else:
        raise ValueError(f"pool must be 'mean_std' or 'mean_max', got {mode!r}")
    return torch.cat([flat.mean(-1), second], 1)


class QualityNet(nn.Module):
    """CNN regressor: image [b, 3, 64, 64] in [0, 1] -> quality logit [b]."""

    kind = "quality"

    def __init__(
        self,
        widths: list[int] | tuple[int, ...] = (16, 32, 64, 64),
        first_kernel: int = 3,
        downsample: str = "pool",
        pool: str = "mean_std",
        hidden: int = 32,
    ):
        super().__init__()
        self.arch = {
            "widths": list(widths),
            "first_kernel": first_kernel,
            "downsample": downsample,
            "pool": pool,
            "hidden": hidden,
        }
        self.features = _conv_stack(3, list(widths), first_kernel, downsample)
        self.pool = pool
        self.head = nn.Sequential(
            nn.Linear(2 * widths[-1], hidden), nn.ReLU(), nn.Linear(hidden, 1)
        )

    def forward(self, images: Tensor) -> Tensor:
        return self.head(_global_pool(self.features(images * 2 - 1), self.pool)).squeeze(-1)


def tokenize(prompts: list[str], vocab: list[str]) -> tuple[Tensor, Tensor]:
    """Prompts -> (ids [b, L] padded with 0, lengths [b]); quotes dropped, lower case.

    This matches how ``world.vocabulary`` spells words; unknown words map to one id so a
    free-form prompt still scores (lower) instead of failing.
    """
    index = {word: i + 2 for i, word in enumerate(vocab)}
    rows = [
        [index.get(word.strip('"').lower(), UNKNOWN) for word in prompt.split()] or [UNKNOWN]
        for prompt in prompts
    ]
    lengths = torch.tensor([len(row) for row in rows], dtype=torch.long)
    ids = torch.full((len(rows), int(lengths.max()) if rows else 1), PAD, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return ids, lengths


class AlignmentNet(nn.Module):
    """Dual encoder: CNN over the image (+ x, y coordinate planes) and a GRU over words.

    The coordinate planes let globally pooled features say *where* a color or shape
    is, which spatial-relation prompts need; the GRU (not a bag of words) keeps word
    order, which color binding ("a red circle and a blue square") needs.
    """

    kind = "alignment"

    def __init__(
        self,
        vocab: list[str] | tuple[str, ...],
        widths: list[int] | tuple[int, ...] = (24, 48, 64, 96),
        embed_dim: int = 64,
        word_dim: int = 32,
        text_hidden: int = 64,
    ):
        super().__init__()
        self.vocab = list(vocab)
        self.arch = {
            "vocab": self.vocab,
            "widths": list(widths),
            "embed_dim": embed_dim,
            "word_dim": word_dim,
            "text_hidden": text_hidden,
        }
        self.image_features = _conv_stack(5, list(widths), 3, "pool")
        self.image_proj = nn.Linear(2 * widths[-1], embed_dim)
        self.words = nn.Embedding(len(self.vocab) + 2, word_dim, padding_idx=PAD)
        self.gru = nn.GRU(word_dim, text_hidden, batch_first=True)
        self.text_proj = nn.Linear(text_hidden, embed_dim)
        # CLIP's learnable temperature, initialised at 1 / 0.07; used only in training.
        self.logit_scale = nn.Parameter(torch.tensor(2.659))

    def encode_images(self, images: Tensor) -> Tensor:
        """[b, 3, 64, 64] in [0, 1] -> unit vectors [b, embed_dim]."""
        b, _, h, w = images.shape
        ys = torch.linspace(-1, 1, h, device=images.device, dtype=images.dtype)
        xs = torch.linspace(-1, 1, w, device=images.device, dtype=images.dtype)
        grid = torch.stack(torch.meshgrid(ys, xs, indexing="ij")).expand(b, 2, h, w)
        features = self.image_features(torch.cat([images * 2 - 1, grid], 1))
        return F.normalize(self.image_proj(_global_pool(features, "mean_max")), dim=-1)

    def encode_text(self, prompts: list[str]) -> Tensor:
        """Prompts -> unit vectors [b, embed_dim] (the GRU state after the last word)."""
        device = self.words.weight.device
        ids, lengths = tokenize(prompts, self.vocab)
        packed = nn.utils.rnn.pack_padded_sequence(
            self.words(ids.to(device)), lengths, batch_first=True, enforce_sorted=False
        )
        _, state = self.gru(packed)
        return F.normalize(self.text_proj(state[-1]), dim=-1)

    def forward(self, images: Tensor, prompts: list[str]) -> Tensor:
        """Cosine similarity of each image with its own prompt, [b]."""
        return (self.encode_images(images) * self.encode_text(prompts)).sum(-1)


MODELS: dict[str, type[nn.Module]] = {"quality": QualityNet, "alignment": AlignmentNet}


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --- checkpoints ---------------------------------------------------------------------------


def save_scorer(
    model: QualityNet | AlignmentNet,
    directory: str | os.PathLike,
    name: str,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write ``<name>.safetensors`` (weights) and ``<name>.json`` (architecture + notes)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {key: value.detach().cpu().contiguous() for key, value in model.state_dict().items()}
    save_file(state, directory / f"{name}.safetensors")
    config = {"kind": model.kind, "arch": model.arch, **(extra or {})}
    (directory / f"{name}.json").write_text(json.dumps(config, indent=1) + "\n")
    return directory / f"{name}.safetensors"


def load_scorer(
    directory: str | os.PathLike, name: str
) -> tuple[QualityNet | AlignmentNet, dict[str, Any]]:
    """Rebuild a scorer from its json config and load its weights, in eval mode."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config = json.loads((directory / f"{name}.json").read_text())
    model = MODELS[config["kind"]](**config["arch"])
    model.load_state_dict(load_file(directory / f"{name}.safetensors"))
    return model.requires_grad_(False).eval(), config  # type: ignore[return-value]


def to_model_input(images: Tensor, device: torch.device) -> Tensor:
    """Any-resolution [b, 3, H, W] in [0, 1] -> [b, 3, 64, 64] float32 on ``device``."""
    images = images.detach().to(device, torch.float32).clamp(0, 1)
    if images.shape[-2:] != (IMAGE_SIZE, IMAGE_SIZE):
        images = F.interpolate(
            images, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", antialias=True
        ).clamp(0, 1)
    return images


# --- rewards -------------------------------------------------------------------------------


class _MiniScorer(Reward):
    """Loads ``<name>.safetensors`` / ``<name>.json`` from ``path`` (default: shipped)."""

    kind: ClassVar[str]

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        device: str | torch.device | None = None,
        batch_size: int | None = None,
    ):
        super().__init__(device, batch_size)
        directory = require_files(
            self.name,
            WEIGHTS_DIR if path is None else path,
            [f"{self.name}.safetensors", f"{self.name}.json"],
            HOW_TO_GET,
        )
        model, self.config = load_scorer(directory, self.name)
        if model.kind != self.kind:
            raise ValueError(
                f"reward {self.name!r}: {directory} holds a {model.kind!r} scorer, "
                f"expected {self.kind!r}"
            )
        self.model = model.to(self.device)

    def to(self, device: str | torch.device) -> _MiniScorer:
        super().to(device)
        self.model.to(self.device)
        return self


@register_reward
class MiniPreference(_MiniScorer):
    """Predicted image quality in [0, 1] (1: a clean render); the prompt is not used."""

    name = "mini_preference"
    value_range = (0.0, 1.0)
    kind = "quality"

    @torch.no_grad()
    def score(self, images: Tensor, prompts: list[str], metadata: Metadata | None) -> Tensor:
        return torch.sigmoid(self.model(to_model_input(images, self.device))).cpu()


@register_reward
class MiniPreferenceHeldout(MiniPreference):
    """The evaluation-only quality scorer: same scale, independently trained."""

    name = "mini_preference_heldout"


@register_reward
class MiniAlignment(_MiniScorer):
    """Cosine in [-1, 1] between the image and prompt embeddings (CLIPScore analogue)."""

    name = "mini_alignment"
    value_range = (-1.0, 1.0)
    kind = "alignment"

    @torch.no_grad()
    def score(self, images: Tensor, prompts: list[str], metadata: Metadata | None) -> Tensor:
        return self.model(to_model_input(images, self.device), prompts).clamp(-1, 1).cpu()
