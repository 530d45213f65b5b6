"""Tiny random reward backbones saved in the layouts the reward loaders expect."""

from __future__ import annotations

from pathlib import Path

import torch

from mogradient_diffusion.model.tiny import _clip_tokenizer

WORDS = ("photo", "cat", "dog", "red", "blue", "sign", "saying", "hello", "two", "of", "a")
IMAGE_SIZE = 32


def save_tiny_clip(directory: Path, seed: int = 0, projection_dim: int = 12) -> Path:
    """A random ``CLIPModel`` with tokenizer and PIL image processor, ``save_pretrained``."""
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel

    torch.manual_seed(seed)
    tokenizer = _clip_tokenizer(WORDS)
    config = CLIPConfig(
        projection_dim=projection_dim,
        text_config={
            "vocab_size": len(tokenizer.get_vocab()),
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "max_position_embeddings": 77,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
        },
        vision_config={
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": IMAGE_SIZE,
            "patch_size": 8,
        },
    )
    CLIPModel(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    processor = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    processor.save_pretrained(directory)
    return directory
