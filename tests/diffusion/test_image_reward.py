"""ImageReward on a tiny random BLIP: loading, batching, the reference's scoring recipe
recomputed by hand, missing weights, and the checkpoint converter round trip."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tolerances import chain_atol

pytest.importorskip("transformers")

from safetensors.torch import save_file
from transformers import (
    BertTokenizer,
    BlipConfig,
    BlipForImageTextRetrieval,
    BlipImageProcessorPil,
    BlipProcessor,
)

from mogradient_diffusion.rewards.aesthetic import aesthetic_head
from mogradient_diffusion.rewards.image_reward import (
    ImageReward,
    convert_image_reward_checkpoint,
)
from mogradient_diffusion.rewards.local_weights import MissingWeightsError
from mogradient_diffusion.rewards.registry import REWARDS

WORDS = "a an the cat dog red blue green on under photo of painting sky tree car big small"
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
IMAGE_SIZE, PATCH, VISION_WIDTH, TEXT_WIDTH = 32, 8, 24, 16
VISION_LAYERS, TEXT_LAYERS, VISION_HEADS, TEXT_HEADS = 2, 2, 2, 2
CLIP_MEAN = np.array([0.48145466, 0.4578275, 0.40821073])
CLIP_STD = np.array([0.26862954, 0.26130258, 0.27577711])
PROMPTS = ["a red cat on the sky", "a photo of a big blue car", "painting of a tree", "a dog"]


def write_vocab(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.txt").write_text("\n".join(SPECIAL + WORDS.split()) + "\n")
    return directory


def blip_tokenizer(vocab_dir: Path) -> BertTokenizer:
    tokenizer = BertTokenizer.from_pretrained(vocab_dir, local_files_only=True)
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    return tokenizer


def tiny_model(vocab_size: int, bos: int) -> BlipForImageTextRetrieval:
    torch.manual_seed(0)
    config = BlipConfig(
        vision_config={
            "hidden_size": VISION_WIDTH,
            "intermediate_size": 4 * VISION_WIDTH,
            "num_hidden_layers": VISION_LAYERS,
            "num_attention_heads": VISION_HEADS,
            "image_size": IMAGE_SIZE,
            "patch_size": PATCH,
            "layer_norm_eps": 1e-6,
        },
        text_config={
            "vocab_size": vocab_size,
            "hidden_size": TEXT_WIDTH,
            "intermediate_size": 4 * TEXT_WIDTH,
            "num_hidden_layers": TEXT_LAYERS,
            "num_attention_heads": TEXT_HEADS,
            "max_position_embeddings": 40,
            "bos_token_id": bos,
            "sep_token_id": 3,
        },
        image_text_hidden_size=8,
    )
    model = BlipForImageTextRetrieval(config).eval()
    with torch.no_grad():  # random init leaves some tensors at zero/one; make all informative
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("image_reward")
    tokenizer = blip_tokenizer(write_vocab(root / "vocab"))
    model = tiny_model(len(tokenizer), tokenizer.bos_token_id)
    torch.manual_seed(1)
    head = aesthetic_head(TEXT_WIDTH).eval()
    processor = BlipImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE},
        do_center_crop=True,
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
    )
    directory = root / "model"
    model.save_pretrained(directory)
    BlipProcessor(processor, tokenizer).save_pretrained(directory)
    save_file(
        {f"layers.{k}": v for k, v in head.state_dict().items()}, directory / "mlp.safetensors"
    )
    return {"root": root, "dir": directory, "model": model, "head": head, "tokenizer": tokenizer}


def images(batch: int, seed: int = 0, height: int = 40, width: int = 48) -> torch.Tensor:
    return torch.rand(batch, 3, height, width, generator=torch.Generator().manual_seed(seed))


def reference_pixels(image: torch.Tensor) -> torch.Tensor:
    """The reference transform by hand: bicubic short side, centre crop, CLIP mean/std."""
    array = (image.permute(1, 2, 0).numpy() * 255).round().clip(0, 255).astype(np.uint8)
    pil = Image.fromarray(array)
    w, h = pil.size
    scale = IMAGE_SIZE / min(w, h)
    pil = pil.resize((int(w * scale), int(h * scale)), Image.Resampling.BICUBIC)
    left, top = (pil.size[0] - IMAGE_SIZE) // 2, (pil.size[1] - IMAGE_SIZE) // 2
    pil = pil.crop((left, top, left + IMAGE_SIZE, top + IMAGE_SIZE))
    normalized = (np.asarray(pil, dtype=np.float64) / 255 - CLIP_MEAN) / CLIP_STD
    return torch.from_numpy(normalized).permute(2, 0, 1).float()


@torch.no_grad()
def reference_scores(tiny: dict, batch: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """``ImageReward.score`` recomputed with the tiny model's modules, one sample at a time."""
    model, tokenizer = tiny["model"], tiny["tokenizer"]
    out = []
    for image, prompt in zip(batch, prompts, strict=True):
        image_embeds = model.vision_model(reference_pixels(image)[None]).last_hidden_state
        tokens = tokenizer(
            prompt, padding="max_length", truncation=True, max_length=35, return_tensors="pt"
        )
        assert tokens["input_ids"][0, 0].item() == tokenizer.cls_token_id
        text = model.text_encoder(
            input_ids=tokens["input_ids"],
            attention_mask=tokens["attention_mask"],
            encoder_hidden_states=image_embeds,
            encoder_attention_mask=torch.ones(image_embeds.shape[:-1], dtype=torch.long),
        )
        raw = tiny["head"](text.last_hidden_state[:, 0, :]).item()
        out.append((raw - 0.16717362830052426) / 1.0333394966054072)
    return torch.tensor(out)


def test_registered_under_its_name():
    assert REWARDS["image_reward"] is ImageReward
    assert ImageReward.value_range == (-math.inf, math.inf)


def test_scores_match_the_reference_recipe(tiny):
    reward = ImageReward(path=tiny["dir"])
    batch = images(len(PROMPTS))
    scores = reward(batch, PROMPTS)
    assert scores.shape == (len(PROMPTS),) and scores.dtype == torch.float32
    assert torch.isfinite(scores).all()
    torch.testing.assert_close(scores, reference_scores(tiny, batch, PROMPTS), atol=1e-4, rtol=0)


def test_batch_size_does_not_change_scores(tiny):
    batch = images(5, seed=3)
    prompts = [*PROMPTS, "green sky"]
    whole = ImageReward(path=tiny["dir"])(batch, prompts)
    chunked = ImageReward(path=tiny["dir"], batch_size=2)(batch, prompts)
    # Chunks of 2 change the GEMM shapes of every layer (vision tower, text cross-attention,
    # MLP head): 64 ulps of the scores' scale.
    atol = chain_atol(torch.float32, whole.abs().max(), ulps=64)
    torch.testing.assert_close(chunked, whole, atol=atol, rtol=0)


def test_prompt_changes_score_and_tokens_are_padded(tiny):
    reward = ImageReward(path=tiny["dir"])
    image = images(1, seed=5).expand(2, -1, -1, -1)
    scores = reward(image, ["a red cat", "a green tree under the blue sky"])
    assert abs(scores[0] - scores[1]) > 1e-4
    tokens = reward.tokenizer(["a dog"], padding="max_length", truncation=True, max_length=35)
    assert len(tokens["input_ids"][0]) == 35
    assert reward.tokenizer.convert_tokens_to_ids(["[DEC]", "[ENC]"]) == [
        len(reward.tokenizer) - 2,
        len(reward.tokenizer) - 1,
    ]


def test_missing_weights_name_the_reward(tiny, tmp_path):
    with pytest.raises(MissingWeightsError, match=r"image_reward.*THUDM/ImageReward"):
        ImageReward()
    with pytest.raises(MissingWeightsError, match="image_reward"):
        ImageReward(path=tmp_path / "absent")
    partial = tmp_path / "partial"
    partial.mkdir()
    for name in ("config.json", "model.safetensors", "processor_config.json", "tokenizer.json"):
        (partial / name).write_bytes((tiny["dir"] / name).read_bytes())
    with pytest.raises(MissingWeightsError, match=r"mlp\.safetensors"):
        ImageReward(path=partial)


# --- converter ----------------------------------------------------------------------------


def released_layout(model: BlipForImageTextRetrieval, head: torch.nn.Module) -> dict:
    """The tiny model's weights under the names of the released ``ImageReward.pt``."""
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    out = {
        "blip.visual_encoder.cls_token": sd["vision_model.embeddings.class_embedding"],
        "blip.visual_encoder.pos_embed": sd["vision_model.embeddings.position_embedding"],
        "blip.visual_encoder.norm.weight": sd["vision_model.post_layernorm.weight"],
        "blip.visual_encoder.norm.bias": sd["vision_model.post_layernorm.bias"],
    }
    for p in ("weight", "bias"):
        out[f"blip.visual_encoder.patch_embed.proj.{p}"] = sd[
            f"vision_model.embeddings.patch_embedding.{p}"
        ]
        out[f"blip.vision_proj.{p}"] = sd[f"vision_proj.{p}"]
        out[f"blip.text_proj.{p}"] = sd[f"text_proj.{p}"]
        for i in range(VISION_LAYERS):
            ours = f"vision_model.encoder.layers.{i}."
            theirs = f"blip.visual_encoder.blocks.{i}."
            for src, dst in (
                ("norm1", "layer_norm1"),
                ("attn.qkv", "self_attn.qkv"),
                ("attn.proj", "self_attn.projection"),
                ("norm2", "layer_norm2"),
                ("mlp.fc1", "mlp.fc1"),
                ("mlp.fc2", "mlp.fc2"),
            ):
                out[f"{theirs}{src}.{p}"] = sd[f"{ours}{dst}.{p}"]
    for key, value in sd.items():
        if key.startswith("text_encoder."):
            out["blip." + key] = value
    out["blip.text_encoder.embeddings.position_ids"] = torch.arange(40)[None]
    for key, value in head.state_dict().items():
        out[f"mlp.layers.{key}"] = value.clone()
    return out


def convert(tiny: dict, tmp_path: Path, state: dict, **kwargs) -> Path:
    checkpoint = tmp_path / "ImageReward.pt"
    torch.save(state, checkpoint)
    med = tmp_path / "med_config.json"
    med.write_text(
        json.dumps(
            {
                "hidden_size": TEXT_WIDTH,
                "num_attention_heads": TEXT_HEADS,
                "layer_norm_eps": 1e-12,
                "vocab_size": len(tiny["tokenizer"]),
                "encoder_width": VISION_WIDTH,
                "add_cross_attention": True,
            }
        )
    )
    return convert_image_reward_checkpoint(
        checkpoint,
        tmp_path / "converted",
        tiny["root"] / "vocab",
        med_config=med,
        vision_heads=VISION_HEADS,
        **kwargs,
    )


def test_converter_round_trip(tiny, tmp_path):
    state = released_layout(tiny["model"], tiny["head"])
    out = convert(tiny, tmp_path, state)
    converted = BlipForImageTextRetrieval.from_pretrained(out, local_files_only=True)
    expected = tiny["model"].state_dict()
    got = converted.state_dict()
    assert set(got) == set(expected)
    for key, value in expected.items():
        if key.startswith("itm_head."):  # not part of ImageReward: zero-filled
            assert not got[key].any()
        else:
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
    assert converted.config.vision_config.layer_norm_eps == 1e-6
    batch = images(3, seed=7, height=48, width=40)
    prompts = PROMPTS[:3]
    torch.testing.assert_close(
        ImageReward(path=out)(batch, prompts),
        ImageReward(path=tiny["dir"])(batch, prompts),
        atol=1e-5,
        rtol=0,
    )


def test_converter_refuses_unknown_and_incomplete_checkpoints(tiny, tmp_path):
    state = released_layout(tiny["model"], tiny["head"])
    with pytest.raises(ValueError, match="unknown"):
        convert(tiny, tmp_path, {**state, "blip.surprise": torch.zeros(1)})
    incomplete = {k: v for k, v in state.items() if "blocks.1.attn.proj" not in k}
    with pytest.raises(ValueError, match="missing"):
        convert(tiny, tmp_path, incomplete)
