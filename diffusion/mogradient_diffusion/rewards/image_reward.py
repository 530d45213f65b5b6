"""ImageReward (Xu et al. 2023): a BLIP image-text cross-encoder with an MLP head.

The reference (``THUDM/ImageReward``, ``ImageReward.score``) embeds the image with a BLIP
ViT-L/16 at 224 px, runs the BERT-base text encoder on the prompt (padded to 35 tokens,
first token left as ``[CLS]``) with cross-attention to every image token, feeds the
``[CLS]`` row to a 768-1024-128-64-16-1 MLP and standardizes the result with the fixed
constants below, so a typical SD image scores around 0 and a good one above 1.

The BLIP half is transformers' ``BlipForImageTextRetrieval`` (the same ViT and the same
med/BERT text encoder, so only names differ);
[`convert_image_reward_checkpoint`][mogradient_diffusion.rewards.image_reward.convert_image_reward_checkpoint]
renames the released ``ImageReward.pt`` into that layout once, on a machine that has the files, so
training nodes load everything with ``local_files_only``.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .aesthetic import aesthetic_head, load_aesthetic_head
from .base import Metadata, Reward, to_uint8_images
from .local_weights import TOKENIZER_FILES, WEIGHT_FILES, require_files
from .registry import register_reward
from .state_files import load_state_dict

HOW_TO_GET = (
    "On a machine with hub access download `ImageReward.pt` and `med_config.json` from "
    "`THUDM/ImageReward` and the `bert-base-uncased` tokenizer (`huggingface-cli download "
    "bert-base-uncased vocab.txt tokenizer.json tokenizer_config.json --local-dir <tok>`), "
    "then run `mogradient-diffusion convert-image-reward ImageReward.pt <tok> <dir> "
    "--med-config med_config.json` and pass <dir> as `path`."
)

# The reference's standardization of the raw MLP output (ImageReward.mean / .std).
REWARD_MEAN = 0.16717362830052426
REWARD_STD = 1.0333394966054072
MAX_LENGTH = 35
HEAD_FILE = "mlp.safetensors"
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
IMAGE_REWARD_FILES = ("config.json", WEIGHT_FILES, PROCESSOR_FILES, TOKENIZER_FILES, HEAD_FILE)
# BLIP's ViT normalizes with eps 1e-6 (transformers' BlipVisionConfig defaults to 1e-5).
BLIP_VIT_LAYER_NORM_EPS = 1e-6


@register_reward
class ImageReward(Reward):
    """ImageReward human-preference score of (image, prompt), standardized as the reference.

    ``path`` is a directory written by
    [`convert_image_reward_checkpoint`][mogradient_diffusion.rewards.image_reward.convert_image_reward_checkpoint]
    (or any ``BlipForImageTextRetrieval`` saved with its processor plus ``mlp.safetensors``).
    ``max_length`` is the padded prompt length; 35 as the reference.
    """

    name = "image_reward"
    value_range = (-math.inf, math.inf)

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        device: str | torch.device | None = None,
        batch_size: int | None = None,
        max_length: int = MAX_LENGTH,
    ):
        from transformers import AutoTokenizer, BlipForImageTextRetrieval, BlipImageProcessorPil

        super().__init__(device, batch_size)
        directory = require_files(self.name, path, IMAGE_REWARD_FILES, HOW_TO_GET)
        self.max_length = max_length
        self.model = BlipForImageTextRetrieval.from_pretrained(
            directory, local_files_only=True, dtype=torch.float32
        )
        self.model.requires_grad_(False).eval().to(self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        self.image_processor = BlipImageProcessorPil.from_pretrained(
            directory, local_files_only=True
        )
        text_width = self.model.config.text_config.hidden_size
        self.head = load_aesthetic_head(directory / HEAD_FILE, text_width).to(self.device)

    def to(self, device: str | torch.device) -> ImageReward:
        super().to(device)
        self.model.to(self.device)
        self.head.to(self.device)
        return self

    @torch.no_grad()
    def features(self, images: Tensor, prompts: list[str]) -> Tensor:
        """The text encoder's ``[CLS]`` row after cross-attending to the image: [b, 768]."""
        arrays = to_uint8_images(images)
        pixels = self.image_processor(images=list(arrays), return_tensors="pt")["pixel_values"]
        image_embeds = self.model.vision_model(
            pixel_values=pixels.to(self.device, self.model.dtype)
        ).last_hidden_state
        tokens = self.tokenizer(
            prompts,
            padding="max_length",
            truncation=True,
            max_length=self.max_length,
            return_tensors="pt",
        )
        image_mask = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=self.device)
        text = self.model.text_encoder(
            input_ids=tokens["input_ids"].to(self.device),
            attention_mask=tokens["attention_mask"].to(self.device),
            encoder_hidden_states=image_embeds,
            encoder_attention_mask=image_mask,
        )
        return text.last_hidden_state[:, 0, :].float()

    @torch.no_grad()
    def score(self, images: Tensor, prompts: list[str], metadata: Metadata | None) -> Tensor:
        raw = self.head(self.features(images, prompts)).squeeze(-1)
        return ((raw - REWARD_MEAN) / REWARD_STD).cpu()


# --- conversion of the released checkpoint ------------------------------------------------

_VIT = r"blip\.visual_encoder\."
_BLOCK = _VIT + r"blocks\.(\d+)\."
_LAYER = r"vision_model.encoder.layers.\1."
# (source pattern, target template); the first match wins. Text keys keep their med/BERT
# names under `text_encoder.`, which transformers' BlipTextModel uses unchanged.
_RENAMES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), target)
    for pattern, target in (
        (_VIT + r"cls_token$", "vision_model.embeddings.class_embedding"),
        (_VIT + r"pos_embed$", "vision_model.embeddings.position_embedding"),
        (
            _VIT + r"patch_embed\.proj\.(weight|bias)$",
            r"vision_model.embeddings.patch_embedding.\1",
        ),
        (_BLOCK + r"norm1\.(weight|bias)$", _LAYER + r"layer_norm1.\2"),
        (_BLOCK + r"attn\.qkv\.(weight|bias)$", _LAYER + r"self_attn.qkv.\2"),
        (_BLOCK + r"attn\.proj\.(weight|bias)$", _LAYER + r"self_attn.projection.\2"),
        (_BLOCK + r"norm2\.(weight|bias)$", _LAYER + r"layer_norm2.\2"),
        (_BLOCK + r"mlp\.(fc[12])\.(weight|bias)$", _LAYER + r"mlp.\2.\3"),
        (_VIT + r"norm\.(weight|bias)$", r"vision_model.post_layernorm.\1"),
        (r"blip\.text_encoder\.(.+)$", r"text_encoder.\1"),
        (r"blip\.(vision_proj|text_proj)\.(weight|bias)$", r"\1.\2"),
    )
)
# Buffers old BERT checkpoints saved; transformers recomputes them.
_DROPPED = re.compile(r"blip\.text_encoder\.embeddings\.position_ids$")
_HEAD = re.compile(r"mlp\.(layers\.\d+\.(?:weight|bias))$")
# Parts of BlipForImageTextRetrieval that ImageReward never trained or uses: zero-filled
# when the checkpoint lacks them, so the saved model is complete and deterministic.
_UNUSED_HEADS = ("itm_head.", "vision_proj.", "text_proj.")


def rename_image_reward_state(
    state: Mapping[str, Tensor],
) -> tuple[dict[str, Tensor], dict[str, Tensor], list[str]]:
    """Split a released state dict into (BLIP weights, MLP head weights, unknown keys).

    BLIP keys get transformers' ``BlipForImageTextRetrieval`` names; head keys become
    ``layers.N.*``; keys matching nothing are returned so the caller can refuse them.
    Two source keys landing on one target name raise ``ValueError``.
    """
    blip: dict[str, Tensor] = {}
    head: dict[str, Tensor] = {}
    unknown: list[str] = []
    for key, value in state.items():
        if _DROPPED.match(key):
            continue
        if match := _HEAD.match(key):
            head[match.group(1)] = value
            continue
        target = next((pat.sub(tpl, key) for pat, tpl in _RENAMES if pat.match(key)), None)
        if target is None:
            unknown.append(key)
        elif target in blip:
            raise ValueError(f"two checkpoint keys map to {target!r} (the second is {key!r})")
        else:
            blip[target] = value
    return blip, head, unknown


def _count_layers(state: Mapping[str, Tensor], pattern: str) -> int:
    indices = {int(m.group(1)) for key in state if (m := re.match(pattern, key))}
    if indices != set(range(len(indices))):
        raise ValueError(f"non-contiguous layer indices for {pattern!r}: {sorted(indices)}")
    return len(indices)


def _blip_config(
    blip: Mapping[str, Tensor], med: Mapping[str, Any], vision_heads: int, bos: int, sep: int
) -> Any:
    """A BlipConfig whose sizes are read off the tensors (heads and eps come from args)."""
    from transformers import BlipConfig

    width = blip["vision_model.embeddings.class_embedding"].shape[-1]
    patch = blip["vision_model.embeddings.patch_embedding.weight"].shape[-1]
    grid = math.isqrt(blip["vision_model.embeddings.position_embedding"].shape[1] - 1)
    vocab, hidden = blip["text_encoder.embeddings.word_embeddings.weight"].shape
    for name, actual in (("hidden_size", hidden), ("vocab_size", vocab), ("encoder_width", width)):
        if name in med and med[name] != actual:
            raise ValueError(f"med_config {name}={med[name]} but the checkpoint has {actual}")
    vision = {
        "hidden_size": width,
        "intermediate_size": blip["vision_model.encoder.layers.0.mlp.fc1.weight"].shape[0],
        "num_hidden_layers": _count_layers(blip, r"vision_model\.encoder\.layers\.(\d+)\."),
        "num_attention_heads": vision_heads,
        "image_size": grid * patch,
        "patch_size": patch,
        "hidden_act": "gelu",
        "layer_norm_eps": BLIP_VIT_LAYER_NORM_EPS,
    }
    text = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": blip["text_encoder.encoder.layer.0.intermediate.dense.weight"].shape[
            0
        ],
        "num_hidden_layers": _count_layers(blip, r"text_encoder\.encoder\.layer\.(\d+)\."),
        "num_attention_heads": med.get("num_attention_heads", 12),
        "max_position_embeddings": blip["text_encoder.embeddings.position_embeddings.weight"].shape[
            0
        ],
        "hidden_act": med.get("hidden_act", "gelu"),
        "layer_norm_eps": med.get("layer_norm_eps", 1e-12),
        "pad_token_id": med.get("pad_token_id", 0),
        "bos_token_id": bos,
        "sep_token_id": sep,
    }
    proj = blip.get("vision_proj.weight")
    return BlipConfig(
        vision_config=vision,
        text_config=text,
        image_text_hidden_size=256 if proj is None else proj.shape[0],
    )


EXPECTED_CHECKPOINT = "the ImageReward.pt released in THUDM/ImageReward"


def convert_image_reward_checkpoint(
    checkpoint_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    tokenizer_dir: str | os.PathLike,
    *,
    med_config: str | os.PathLike | None = None,
    vision_heads: int = 16,
    strict: bool = True,
) -> Path:
    """Write ``ImageReward.pt`` as a directory the ``image_reward`` reward loads.

    Renames the BLIP keys (timm ViT and med/BERT names) to transformers'
    ``BlipForImageTextRetrieval`` names, reads layer sizes off the tensors, takes text
    heads/eps from ``med_config`` (``med_config.json``; BERT-base defaults without it),
    saves the ``bert-base-uncased`` tokenizer from ``tokenizer_dir`` with BLIP's added
    ``[DEC]`` (bos) and ``[ENC]`` tokens, a BLIP image processor configured as the
    reference's transform (bicubic short-side resize, centre crop, CLIP mean/std) and the
    MLP head as ``mlp.safetensors``. ``itm_head`` (absent from ImageReward) is zeros.

    Every model key must be filled exactly once with the expected shape; unknown source
    keys raise unless ``strict=False``. This mapping is checked in the tests on
    synthetic state dicts built from a tiny model (round trip, shapes, full coverage),
    not on the released checkpoint, which could not be downloaded where it was written.
    """
    from safetensors.torch import save_file
    from transformers import (
        BertTokenizer,
        BlipForImageTextRetrieval,
        BlipImageProcessorPil,
        BlipProcessor,
    )
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, PILImageResampling

    checkpoint_path = Path(checkpoint_path)
    state = load_state_dict(checkpoint_path, EXPECTED_CHECKPOINT)
    blip, head, unknown = rename_image_reward_state(state)
    if unknown and strict:
        raise ValueError(
            f"{checkpoint_path} has unknown ImageReward checkpoint keys {unknown[:10]}: "
            f"expected {EXPECTED_CHECKPOINT}"
        )
    med = json.loads(Path(med_config).read_text()) if med_config is not None else {}

    tokenizer = BertTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    try:
        vocab = blip["text_encoder.embeddings.word_embeddings.weight"].shape[0]
        bos, sep = tokenizer.bos_token_id, tokenizer.sep_token_id
        config = _blip_config(blip, med, vision_heads, bos, sep)
    except KeyError as error:  # a state dict of some other model
        raise ValueError(
            f"{checkpoint_path} has no BLIP tensor {error.args[0]!r}: expected "
            f"{EXPECTED_CHECKPOINT}"
        ) from None
    if len(tokenizer) != vocab:
        raise ValueError(
            f"tokenizer has {len(tokenizer)} tokens with [DEC] and [ENC], the checkpoint "
            f"{vocab}: use the bert-base-uncased tokenizer"
        )

    with torch.device("meta"):
        expected = BlipForImageTextRetrieval(config).state_dict()
    for key, value in expected.items():
        if key not in blip and key.startswith(_UNUSED_HEADS):
            blip[key] = torch.zeros(value.shape, dtype=value.dtype)
    missing = sorted(set(expected) - set(blip))
    extra = sorted(set(blip) - set(expected))
    wrong = [k for k in expected if k in blip and blip[k].shape != expected[k].shape]
    if missing or extra or wrong:
        raise ValueError(
            f"checkpoint does not fit BlipForImageTextRetrieval: missing {missing[:5]}, "
            f"unexpected {extra[:5]}, wrong shapes {wrong[:5]}"
        )
    head_module = aesthetic_head(config.text_config.hidden_size)
    head_module.load_state_dict({k.removeprefix("layers."): v for k, v in head.items()})

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    tensors = {k: v.detach().float().contiguous().clone() for k, v in blip.items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    save_file(
        {f"layers.{k}": v.contiguous() for k, v in head_module.state_dict().items()},
        out / HEAD_FILE,
    )
    size = config.vision_config.image_size
    image_processor = BlipImageProcessorPil(
        size={"shortest_edge": size},
        do_center_crop=True,
        crop_size={"height": size, "width": size},
        resample=PILImageResampling.BICUBIC,
        image_mean=list(OPENAI_CLIP_MEAN),
        image_std=list(OPENAI_CLIP_STD),
    )
    BlipProcessor(image_processor, tokenizer).save_pretrained(out)
    return out
