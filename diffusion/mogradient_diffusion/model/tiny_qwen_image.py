"""A tiny Qwen-Image pipeline built offline, saved in the layout the real one has.

As for the tiny SD3 ([`mogradient_diffusion.model.tiny`][mogradient_diffusion.model.tiny]), tests
exercise the real loading code (``QwenImagePipeline.from_pretrained``) on random weights. The
tokenizer is byte-level BPE like Qwen2's, with merges that make each word of the pipeline's prompt
template and of a word list one token: the template's system prefix then tokenizes to
the 34 tokens ``QwenImagePipeline`` drops, as with the real tokenizer, so the embeddings
start at the prompt. Dimension rules: the text encoder's width is the transformer's
``joint_attention_dim``; the RoPE axes sum to the attention head size; the transformer
reads 2x2 patches of ``z_dim`` channels.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mogradient_diffusion.model.tiny import DEFAULT_WORDS, _bpe

# The real Qwen-Image scheduler (Qwen/Qwen-Image scheduler/scheduler_config.json):
# exponential time shift by image size (mu), last non-zero sigma stretched to 0.02.
SCHEDULER_CONFIG = {
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
    "use_dynamic_shifting": True,
}
# The first latent statistics of the real VAE: decoding must denormalize with them.
LATENTS_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508)
LATENTS_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# The words of QwenImagePipeline.prompt_template_encode (a test checks that its system
# prefix tokenizes to the pipeline's prompt_template_encode_start_idx tokens).
TEMPLATE_WORDS = tuple(
    (
        "system Describe the image by detailing color shape size texture quantity text "
        "spatial relationships of objects and background user assistant"
    ).split()
)


@dataclass(frozen=True)
class TinyQwenImageSpec:
    """Sizes of the tiny pipeline. Its VAE downsamples 8x, as the real one: 64 px images
    (the tiny preset's) are 8x8 latents and 16 tokens of 2x2 patches, as with the tiny SD3."""

    latent_channels: int = 4  # the VAE's z_dim (16 in Qwen-Image)
    transformer_layers: int = 2
    heads: int = 2
    head_dim: int = 8
    text_hidden: int = 16
    text_layers: int = 1
    vae_width: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        if self.latent_channels > len(LATENTS_MEAN):
            raise ValueError(f"latent_channels must be at most {len(LATENTS_MEAN)}")
        if self.head_dim % 8:
            raise ValueError("head_dim must be a multiple of 8 (RoPE axes of 1/4, 1/4, 1/2)")


def build_tiny_qwen_image_pipeline(
    spec: TinyQwenImageSpec = TinyQwenImageSpec(), words: tuple[str, ...] = ()
):
    """Return a randomly initialised ``QwenImagePipeline`` of the given sizes."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(spec.seed)
    tokenizer = _byte_level_tokenizer(TEMPLATE_WORDS + DEFAULT_WORDS + tuple(words))
    text_heads = 2
    text_head_dim = spec.text_hidden // text_heads
    config = Qwen2_5_VLConfig(
        text_config={
            "hidden_size": spec.text_hidden,
            "intermediate_size": spec.text_hidden,
            "num_hidden_layers": spec.text_layers,
            "num_attention_heads": text_heads,
            "num_key_value_heads": text_heads,
            # multimodal RoPE sections (temporal, height, width) sum to half a head
            "rope_scaling": {
                "mrope_section": _mrope_sections(text_head_dim),
                "rope_type": "default",
            },
            "vocab_size": len(tokenizer),
            "bos_token_id": None,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "depth": 1,
            "hidden_size": spec.text_hidden,
            "intermediate_size": spec.text_hidden,
            "num_heads": text_heads,
            "out_hidden_size": spec.text_hidden,
        },
    )
    text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval()
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=4 * spec.latent_channels,
        out_channels=spec.latent_channels,
        num_layers=spec.transformer_layers,
        attention_head_dim=spec.head_dim,
        num_attention_heads=spec.heads,
        joint_attention_dim=spec.text_hidden,
        axes_dims_rope=(spec.head_dim // 4, spec.head_dim // 4, spec.head_dim // 2),
    )
    vae = AutoencoderKLQwenImage(
        base_dim=spec.vae_width,
        z_dim=spec.latent_channels,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=list(LATENTS_MEAN[: spec.latent_channels]),
        latents_std=list(LATENTS_STD[: spec.latent_channels]),
    )
    return QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )


def save_tiny_qwen_image_pipeline(
    directory: str | Path,
    spec: TinyQwenImageSpec = TinyQwenImageSpec(),
    words: tuple[str, ...] = (),
) -> Path:
    """Build a tiny pipeline and ``save_pretrained`` it (safetensors) to ``directory``."""
    directory = Path(directory)
    build_tiny_qwen_image_pipeline(spec, words).save_pretrained(directory)
    return directory


def _mrope_sections(head_dim: int) -> list[int]:
    """Qwen2.5-VL's rotary sections (temporal, height, width): they sum to ``head_dim / 2``."""
    half = head_dim // 2
    if half < 3:
        raise ValueError(f"the text encoder's head size must be at least 6, got {head_dim}")
    quarter = max(half // 4, 1)
    return [quarter, quarter, half - 2 * quarter]


def _byte_level_tokenizer(words: tuple[str, ...]):
    """Qwen2's byte-level BPE over the 256 byte symbols, with merges that make each word,
    alone or after a space, one token (any other text still tokenizes, byte by byte).

    Each word is first segmented with the merges so far and its leftover parts joined by
    new merges ranked after them, so earlier words keep their segmentation.
    """
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_symbols = bytes_to_unicode()
    vocab = {symbol: i for i, symbol in enumerate(byte_symbols.values())}
    ranks: dict[tuple[str, str], int] = {}
    for word in dict.fromkeys(words):
        for text in (word, " " + word):
            parts = _bpe([byte_symbols[b] for b in text.encode()], ranks)
            while len(parts) > 1:
                ranks.setdefault((parts[0], parts[1]), len(ranks))
                parts = [parts[0] + parts[1], *parts[2:]]
                vocab.setdefault(parts[0], len(vocab))
    for special in SPECIAL_TOKENS:
        vocab[special] = len(vocab)
    merges = sorted(ranks, key=ranks.__getitem__)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    return tokenizer
