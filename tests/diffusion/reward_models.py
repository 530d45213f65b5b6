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


def save_tiny_aesthetic_head(path: Path, embedding_dim: int = 12, seed: int = 1) -> Path:
    """A randomly initialized ``aesthetic_head`` saved under the released keys (``layers.N``)."""
    from safetensors.torch import save_file

    from mogradient_diffusion.rewards.aesthetic import aesthetic_head

    torch.manual_seed(seed)
    state = aesthetic_head(embedding_dim).state_dict()
    save_file({f"layers.{key}": value for key, value in state.items()}, path)
    return path


def save_tiny_image_reward(directory: Path, seed: int = 0) -> Path:
    """A random BLIP retrieval model, BERT tokenizer (``WORDS``), BLIP processor and MLP head,
    in the layout ``convert_image_reward_checkpoint`` writes."""
    from transformers import (
        BertTokenizer,
        BlipConfig,
        BlipForImageTextRetrieval,
        BlipImageProcessorPil,
        BlipProcessor,
    )

    from mogradient_diffusion.rewards.image_reward import HEAD_FILE

    directory.mkdir(parents=True, exist_ok=True)
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    (directory / "vocab.txt").write_text("\n".join([*special, *WORDS]) + "\n")
    tokenizer = BertTokenizer.from_pretrained(directory, local_files_only=True)
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    torch.manual_seed(seed)
    config = BlipConfig(
        vision_config={
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": IMAGE_SIZE,
            "patch_size": 8,
            "layer_norm_eps": 1e-6,
        },
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "max_position_embeddings": 40,
            "bos_token_id": tokenizer.bos_token_id,
            "sep_token_id": tokenizer.sep_token_id,
        },
        image_text_hidden_size=8,
    )
    BlipForImageTextRetrieval(config).save_pretrained(directory)
    processor = BlipImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE},
        do_center_crop=True,
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
    )
    BlipProcessor(processor, tokenizer).save_pretrained(directory)
    save_tiny_aesthetic_head(directory / HEAD_FILE, embedding_dim=16, seed=seed + 1)
    return directory


def save_tiny_mask2former(directory: Path, labels: tuple[str, ...], seed: int = 0) -> Path:
    """A random Mask2Former (Swin backbone, 12 queries) over ``labels``, with its processor."""
    from transformers import (
        Mask2FormerConfig,
        Mask2FormerForUniversalSegmentation,
        Mask2FormerImageProcessorPil,
        SwinConfig,
    )

    torch.manual_seed(seed)
    backbone = SwinConfig(
        embed_dim=8,
        depths=[1, 1, 1, 1],
        num_heads=[1, 1, 1, 1],
        window_size=4,
        image_size=64,
        out_features=["stage1", "stage2", "stage3", "stage4"],
    )
    config = Mask2FormerConfig(
        backbone_config=backbone,
        feature_size=32,
        mask_feature_size=32,
        hidden_dim=32,
        encoder_feedforward_dim=32,
        encoder_layers=1,
        decoder_layers=2,
        num_attention_heads=2,
        dim_feedforward=32,
        num_queries=12,
        id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)},
    )
    Mask2FormerForUniversalSegmentation(config).save_pretrained(directory)
    Mask2FormerImageProcessorPil(size={"height": 64, "width": 64}).save_pretrained(directory)
    return directory
