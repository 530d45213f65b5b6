"""Convert an open_clip CLIP checkpoint (e.g. HPS v2.1) into the transformers CLIP layout.

HPSv2.1 is open_clip's ViT-H-14 fine-tuned; open_clip itself needs torchvision, which
does not install beside a CPU torch here, and its architecture is exactly transformers'
``CLIPModel`` with GELU: pre-norm residual blocks, a fused ``in_proj`` attention,
class-token pooling for images, end-of-text pooling for prompts. So the weights are
renamed (and the fused q/k/v split, the projections transposed) once, and the reward
loads them with the same code as every other CLIP.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

from torch import Tensor

from mogradient_diffusion.rewards.state_files import load_state_dict

# open_clip's ViT-H-14: vision head width 80 (1280 / 80 = 16 heads), text heads 16.
VIT_H_14_HEADS = {"vision": 16, "text": 16}
EXPECTED = "an open_clip CLIP checkpoint such as HPS_v2.1_compressed.pt"


def load_open_clip_state(path: str | os.PathLike) -> dict[str, Tensor]:
    """The model state of an open_clip checkpoint (bare, or under ``state_dict``); a
    ValueError naming the file when it holds none."""
    state = load_state_dict(Path(path).expanduser(), EXPECTED)
    return {key.removeprefix("module."): value for key, value in state.items()}


def clip_config_from_open_clip(
    state: dict[str, Tensor], vision_heads: int, text_heads: int, tokenizer=None
) -> dict:
    """A transformers ``CLIPConfig`` dict whose sizes are read off the tensors.

    The text tower pools at the tokenizer's end-of-text token, so its ids go in the config.
    """
    special = {}
    if tokenizer is not None:
        special = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    vision_width, _, patch, _ = state["visual.conv1.weight"].shape
    positions = state["visual.positional_embedding"].shape[0]
    text_positions, text_width = state["positional_embedding"].shape
    return {
        "model_type": "clip",
        "projection_dim": state["text_projection"].shape[1],
        "logit_scale_init_value": float(state["logit_scale"]),
        "vision_config": {
            "hidden_size": vision_width,
            "intermediate_size": state["visual.transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
            "num_hidden_layers": _count_blocks(state, "visual.transformer.resblocks."),
            "num_attention_heads": vision_heads,
            "patch_size": patch,
            "image_size": patch * math.isqrt(positions - 1),
            "hidden_act": "gelu",
            "layer_norm_eps": 1e-5,
        },
        "text_config": {
            "hidden_size": text_width,
            "intermediate_size": state["transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
            "num_hidden_layers": _count_blocks(state, "transformer.resblocks."),
            "num_attention_heads": text_heads,
            "vocab_size": state["token_embedding.weight"].shape[0],
            "max_position_embeddings": text_positions,
            "hidden_act": "gelu",
            "layer_norm_eps": 1e-5,
            **special,
        },
    }


def open_clip_to_transformers(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rename an open_clip state dict to ``CLIPModel`` keys; every source tensor is used."""
    out = {
        "logit_scale": state["logit_scale"],
        "text_model.embeddings.token_embedding.weight": state["token_embedding.weight"],
        "text_model.embeddings.position_embedding.weight": state["positional_embedding"],
        "text_model.final_layer_norm.weight": state["ln_final.weight"],
        "text_model.final_layer_norm.bias": state["ln_final.bias"],
        "text_projection.weight": state["text_projection"].T.contiguous(),
        "vision_model.embeddings.class_embedding": state["visual.class_embedding"],
        "vision_model.embeddings.patch_embedding.weight": state["visual.conv1.weight"],
        "vision_model.embeddings.position_embedding.weight": state["visual.positional_embedding"],
        "vision_model.pre_layrnorm.weight": state["visual.ln_pre.weight"],
        "vision_model.pre_layrnorm.bias": state["visual.ln_pre.bias"],
        "vision_model.post_layernorm.weight": state["visual.ln_post.weight"],
        "vision_model.post_layernorm.bias": state["visual.ln_post.bias"],
        "visual_projection.weight": state["visual.proj"].T.contiguous(),
    }
    for source, target in (("transformer", "text_model"), ("visual.transformer", "vision_model")):
        for i in range(_count_blocks(state, f"{source}.resblocks.")):
            out.update(_block(state, f"{source}.resblocks.{i}.", f"{target}.encoder.layers.{i}."))
    return out


def _block(state: dict[str, Tensor], src: str, dst: str) -> dict[str, Tensor]:
    q, k, v = state[src + "attn.in_proj_weight"].chunk(3)
    q_bias, k_bias, v_bias = state[src + "attn.in_proj_bias"].chunk(3)
    renamed = {
        "layer_norm1": "ln_1",
        "layer_norm2": "ln_2",
        "self_attn.out_proj": "attn.out_proj",
        "mlp.fc1": "mlp.c_fc",
        "mlp.fc2": "mlp.c_proj",
    }
    out = {
        dst + "self_attn.q_proj.weight": q,
        dst + "self_attn.k_proj.weight": k,
        dst + "self_attn.v_proj.weight": v,
        dst + "self_attn.q_proj.bias": q_bias,
        dst + "self_attn.k_proj.bias": k_bias,
        dst + "self_attn.v_proj.bias": v_bias,
    }
    for new, old in renamed.items():
        for kind in ("weight", "bias"):
            out[f"{dst}{new}.{kind}"] = state[f"{src}{old}.{kind}"]
    return {key: value.contiguous() for key, value in out.items()}


def _count_blocks(state: dict[str, Tensor], prefix: str) -> int:
    indices = {int(key[len(prefix) :].split(".")[0]) for key in state if key.startswith(prefix)}
    if indices != set(range(len(indices))):
        raise ValueError(f"non-contiguous blocks under {prefix!r}: {sorted(indices)}")
    return len(indices)


def convert_open_clip_checkpoint(
    checkpoint: str | os.PathLike,
    processor_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    vision_heads: int = VIT_H_14_HEADS["vision"],
    text_heads: int = VIT_H_14_HEADS["text"],
) -> Path:
    """Write a ``CLIPModel`` directory (safetensors) plus the processor files it is used with.

    ``processor_dir`` holds the tokenizer and ``preprocessor_config.json`` of the base
    CLIP (for HPSv2.1: ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``); its files are copied.
    """
    from transformers import AutoTokenizer, CLIPConfig, CLIPModel

    state = load_open_clip_state(checkpoint)
    converted = _renamed(state, checkpoint)  # a wrong file fails before the tokenizer loads
    tokenizer = AutoTokenizer.from_pretrained(processor_dir, local_files_only=True)
    config = CLIPConfig(**clip_config_from_open_clip(state, vision_heads, text_heads, tokenizer))
    model = CLIPModel(config)
    result = model.load_state_dict(converted, strict=False)
    unexpected = [key for key in result.missing_keys if not key.endswith("position_ids")]
    if unexpected or result.unexpected_keys:
        raise ValueError(
            f"conversion mismatch: missing {unexpected}, unexpected {result.unexpected_keys}"
        )
    out = Path(out_dir).expanduser()
    model.save_pretrained(out)
    for file in Path(processor_dir).expanduser().iterdir():
        if file.is_file() and file.name not in ("config.json", *_WEIGHT_NAMES):
            shutil.copy2(file, out / file.name)
    (out / "conversion.json").write_text(
        json.dumps({"source": str(checkpoint), "processor": str(processor_dir)}, indent=2)
    )
    return out


def _renamed(state: dict[str, Tensor], checkpoint: str | os.PathLike) -> dict[str, Tensor]:
    """``open_clip_to_transformers``, with a missing tensor (the state dict of some other
    model) a one-line ValueError naming the file."""
    try:
        return open_clip_to_transformers(state)
    except KeyError as error:
        raise ValueError(
            f"{checkpoint} has no tensor {error.args[0]!r}: expected {EXPECTED}"
        ) from None


_WEIGHT_NAMES = ("model.safetensors", "pytorch_model.bin", "open_clip_pytorch_model.bin")
