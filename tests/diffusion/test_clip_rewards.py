"""CLIP-based rewards on tiny random CLIPs saved in the real layouts: PickScore, CLIPScore,
HPSv2.1 (through the open_clip conversion, checked against an open_clip-layout forward
written here), Aesthetic; loading errors, batching, device pinning."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from tolerances import chain_atol
from torch import nn

from mogradient_diffusion.rewards import RewardSet
from mogradient_diffusion.rewards.aesthetic import Aesthetic, aesthetic_head
from mogradient_diffusion.rewards.base import to_uint8_images
from mogradient_diffusion.rewards.clip_similarity import ClipScore, HpsV21, PickScore
from mogradient_diffusion.rewards.local_weights import MissingWeightsError
from mogradient_diffusion.rewards.open_clip_conversion import convert_open_clip_checkpoint

from .reward_models import save_tiny_clip

PROMPTS = ["a photo of a cat", 'a red sign saying "hello"', "two blue dogs", "a photo of a dog"]


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory) -> Path:
    return save_tiny_clip(tmp_path_factory.mktemp("clip"))


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.rand(len(PROMPTS), 3, 40, 48, generator=generator)


def reference_logits(clip_dir: Path, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """``logits_per_image`` of the CLIP's own forward (what PickScore's reference uses)."""
    from transformers import AutoTokenizer, CLIPImageProcessorPil, CLIPModel

    model = CLIPModel.from_pretrained(clip_dir).eval()
    pixels = CLIPImageProcessorPil.from_pretrained(clip_dir)(
        images=list(to_uint8_images(images)), return_tensors="pt"
    )["pixel_values"]
    tokens = AutoTokenizer.from_pretrained(clip_dir)(prompts, padding=True, return_tensors="pt")
    with torch.no_grad():
        return model(pixel_values=pixels, **tokens).logits_per_image


def test_pickscore_is_logit_scale_times_cosine_over_26(clip_dir, images):
    expected = reference_logits(clip_dir, images, PROMPTS).diagonal() / 26
    reward = PickScore(path=clip_dir)
    torch.testing.assert_close(reward(images, PROMPTS), expected, rtol=1e-5, atol=1e-6)
    low, high = reward.value_range
    assert high == pytest.approx(reward.clip.logit_scale / 26) and low == -high


def test_clipscore_is_the_cosine_and_prompt_sensitive(clip_dir, images):
    logits = reference_logits(clip_dir, images, PROMPTS)
    reward = ClipScore(path=clip_dir)
    scores = reward(images, PROMPTS)
    expected = logits.diagonal() / reward.clip.logit_scale
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-6)
    assert scores.abs().max() <= 1
    swapped = reward(images, PROMPTS[::-1])
    assert not torch.allclose(scores, swapped)


def test_batch_size_chunks_give_the_same_scores(clip_dir, images):
    whole = PickScore(path=clip_dir)(images, PROMPTS)
    chunked = PickScore(path=clip_dir, batch_size=3)(images, PROMPTS)
    # Chunks of 3 change the GEMM shapes, so each layer of both towers may round
    # differently: 64 ulps of the scores' scale (logit_scale x cosine).
    atol = chain_atol(torch.float32, whole.abs().max(), ulps=64)
    torch.testing.assert_close(whole, chunked, rtol=0, atol=atol)


def test_processor_can_come_from_another_directory(clip_dir, tmp_path, images):
    model_only = tmp_path / "model_only"
    model_only.mkdir()
    for name in ("config.json", "model.safetensors"):
        (model_only / name).write_bytes((clip_dir / name).read_bytes())
    with pytest.raises(MissingWeightsError, match=r"preprocessor_config\.json"):
        PickScore(path=model_only)
    scores = PickScore(path=model_only, processor_path=clip_dir)(images, PROMPTS)
    torch.testing.assert_close(scores, PickScore(path=clip_dir)(images, PROMPTS))


@pytest.mark.parametrize("cls", [PickScore, ClipScore, HpsV21])
def test_missing_weights_name_the_reward_and_the_fix(cls, tmp_path):
    with pytest.raises(MissingWeightsError, match=f"{cls.name}.*path"):
        cls()
    with pytest.raises(MissingWeightsError, match="does not exist"):
        cls(path=tmp_path / "nowhere")
    with pytest.raises(MissingWeightsError, match=r"config\.json"):
        cls(path=tmp_path)


def test_pinned_device_is_kept_by_the_reward_set(clip_dir):
    pinned = ClipScore(path=clip_dir, device="cpu")
    following = PickScore(path=clip_dir)
    RewardSet([pinned, following]).to("meta")
    assert pinned.device == torch.device("cpu")
    assert following.device == torch.device("meta")


# --- Aesthetic --------------------------------------------------------------------------


def test_aesthetic_head_matches_the_released_layout_and_scores(clip_dir, tmp_path, images):
    dim = 12
    head = aesthetic_head(dim)
    keys = sorted(key for key in head.state_dict())
    assert keys == sorted(f"{i}.{kind}" for i in (0, 2, 4, 6, 7) for kind in ("weight", "bias"))
    torch.manual_seed(1)
    state = {f"layers.{key}": torch.randn_like(v) for key, v in head.state_dict().items()}
    torch.save(state, tmp_path / "head.pth")
    reward = Aesthetic(path=clip_dir, head=tmp_path / "head.pth")
    scores = reward(images, PROMPTS)

    embedding = reward.clip.image_features(images, normalize=False)
    x = embedding / embedding.norm(dim=-1, keepdim=True)
    for i in (0, 2, 4, 6, 7):  # five linear maps, no activations
        x = x @ state[f"layers.{i}.weight"].T + state[f"layers.{i}.bias"]
    torch.testing.assert_close(scores, x.squeeze(-1), rtol=1e-5, atol=1e-5)
    with pytest.raises(MissingWeightsError, match="head"):
        Aesthetic(path=clip_dir)
    with pytest.raises(MissingWeightsError, match="not found"):
        Aesthetic(path=clip_dir, head=tmp_path / "missing.pth")


# --- HPSv2.1: open_clip checkpoint -> transformers CLIP ----------------------------------


class OpenClipBlock(nn.Module):
    """open_clip's residual attention block (pre-norm, fused in_proj, GELU MLP)."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            OrderedDict(
                c_fc=nn.Linear(width, 4 * width), gelu=nn.GELU(), c_proj=nn.Linear(4 * width, width)
            )
        )

    def forward(self, x, mask=None):
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, need_weights=False, attn_mask=mask)[0]
        return x + self.mlp(self.ln_2(x))


class OpenClipTower(nn.Module):
    def __init__(self, width: int, heads: int, layers: int):
        super().__init__()
        self.resblocks = nn.ModuleList(OpenClipBlock(width, heads) for _ in range(layers))

    def forward(self, x, mask=None):
        for block in self.resblocks:
            x = block(x, mask)
        return x


class OpenClipVisual(nn.Module):
    def __init__(self, width, heads, layers, patch, image, embed):
        super().__init__()
        grid = image // patch
        self.conv1 = nn.Conv2d(3, width, patch, patch, bias=False)
        self.class_embedding = nn.Parameter(torch.randn(width) * 0.1)
        self.positional_embedding = nn.Parameter(torch.randn(grid * grid + 1, width) * 0.1)
        self.ln_pre = nn.LayerNorm(width)
        self.transformer = OpenClipTower(width, heads, layers)
        self.ln_post = nn.LayerNorm(width)
        self.proj = nn.Parameter(torch.randn(width, embed) * 0.1)

    def forward(self, pixels):
        x = self.conv1(pixels).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(len(x), 1, -1)
        x = self.ln_pre(torch.cat([cls, x], dim=1) + self.positional_embedding)
        return self.ln_post(self.transformer(x)[:, 0]) @ self.proj


class OpenClipModel(nn.Module):
    """The open_clip ``CLIP`` layout (state-dict names and forward), written from its paper."""

    def __init__(self, vocab: int, width=16, heads=2, layers=2, context=77, embed=12):
        super().__init__()
        self.visual = OpenClipVisual(24, 3, 2, 8, 32, embed)
        self.token_embedding = nn.Embedding(vocab, width)
        self.positional_embedding = nn.Parameter(torch.randn(context, width) * 0.1)
        self.transformer = OpenClipTower(width, heads, layers)
        self.ln_final = nn.LayerNorm(width)
        self.text_projection = nn.Parameter(torch.randn(width, embed) * 0.1)
        self.logit_scale = nn.Parameter(torch.tensor(np.log(1 / 0.07), dtype=torch.float32))

    def encode_text(self, ids):
        x = self.token_embedding(ids) + self.positional_embedding[: ids.shape[1]]
        mask = torch.full((ids.shape[1], ids.shape[1]), float("-inf")).triu(1)
        x = self.ln_final(self.transformer(x, mask))
        return x[torch.arange(len(ids)), ids.argmax(-1)] @ self.text_projection


def test_open_clip_conversion_reproduces_the_open_clip_forward(clip_dir, tmp_path, images):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(clip_dir)
    torch.manual_seed(3)
    reference = OpenClipModel(len(tokenizer.get_vocab())).eval()
    for parameter in reference.parameters():  # LayerNorms away from identity
        if parameter.ndim == 1:
            parameter.data.add_(torch.randn_like(parameter) * 0.1)
    torch.save({"state_dict": reference.state_dict()}, tmp_path / "HPS_v2.1_compressed.pt")
    out = convert_open_clip_checkpoint(
        tmp_path / "HPS_v2.1_compressed.pt", clip_dir, tmp_path / "hps", 3, 2
    )
    reward = HpsV21(path=out)

    pixels = reward.clip.pixel_values(images)
    tokens = tokenizer(PROMPTS, padding="max_length", max_length=77, return_tensors="pt")
    with torch.no_grad():
        image_ref = nn.functional.normalize(reference.visual(pixels), dim=-1)
        text_ref = nn.functional.normalize(reference.encode_text(tokens.input_ids), dim=-1)
    torch.testing.assert_close(reward.clip.image_features(images), image_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(reward.clip.text_features(PROMPTS), text_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(
        reward(images, PROMPTS), (image_ref * text_ref).sum(-1), rtol=1e-4, atol=1e-5
    )
    assert reward.value_range == (-1.0, 1.0)
