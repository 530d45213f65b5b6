"""A tiny FLUX.1 pipeline built offline, saved in the layout the real one has.

Like [`tiny`][mogradient_diffusion.model.tiny] for SD3: random weights and tokenizers
trained on a word list, so tests run the real loading and sampling code
(``FluxPipeline``) without a model hub. ``guidance_embeds`` picks a dev-like model
(embedded guidance, dynamic time shift) or a schnell-like one (neither). Dimension rules
FLUX imposes: the rotary axes sum to the head width; the transformer's input channels
are 4 latent channels per 2x2 patch; T5's width is ``joint_attention_dim`` and CLIP's
pooled width (its hidden size) is ``pooled_projection_dim``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mogradient_diffusion.model.tiny import (
    CLIP_MAX_LENGTH,
    _clip_text_config,
    _clip_tokenizer,
    _t5_encoder,
    _t5_tokenizer,
    _tiny_vae,
    _vocabulary,
)

# FLUX.1-dev's scheduler: the shift follows the number of image tokens (mu), from 0.5 at
# 256 tokens to 1.15 at 4096; ``shift`` is unused under dynamic shifting.
DEV_SCHEDULER = {
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}
# FLUX.1-schnell samples without a time shift.
SCHNELL_SCHEDULER = {**DEV_SCHEDULER, "shift": 1.0, "use_dynamic_shifting": False}
# The FLUX VAE's latent normalisation (black-forest-labs/flux, AutoEncoderParams).
VAE_SCALING_FACTOR = 0.3611
VAE_SHIFT_FACTOR = 0.1159


@dataclass(frozen=True)
class TinyFluxSpec:
    """Sizes of the tiny pipeline; defaults give ~30k transformer parameters.

    ``vae_blocks=4`` halves the image three times, as FLUX's VAE does, so 64 px images
    have 8 x 8 latents and 16 packed tokens.
    """

    guidance_embeds: bool = True
    latent_channels: int = 4
    dual_layers: int = 1
    single_layers: int = 1
    heads: int = 2
    head_dim: int = 8
    rope_axes: tuple[int, int, int] = (2, 2, 4)
    clip_hidden: int = 16
    t5_width: int = 32
    vae_width: int = 8
    vae_blocks: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if sum(self.rope_axes) != self.head_dim:
            raise ValueError(f"rope_axes {self.rope_axes} must sum to head_dim {self.head_dim}")


def build_tiny_flux_pipeline(spec: TinyFluxSpec = TinyFluxSpec(), words: tuple[str, ...] = ()):
    """Return a randomly initialised ``FluxPipeline`` of the given sizes."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel

    vocabulary = _vocabulary(words)
    torch.manual_seed(spec.seed)
    clip_tokenizer = _clip_tokenizer(vocabulary, CLIP_MAX_LENGTH)
    t5_tokenizer = _t5_tokenizer(vocabulary)
    text_encoder = CLIPTextModel(
        _clip_text_config(
            clip_tokenizer, spec.clip_hidden, CLIP_MAX_LENGTH, projection_dim=spec.clip_hidden
        )
    )
    text_encoder_2 = _t5_encoder(t5_tokenizer, spec.t5_width)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * spec.latent_channels,
        num_layers=spec.dual_layers,
        num_single_layers=spec.single_layers,
        attention_head_dim=spec.head_dim,
        num_attention_heads=spec.heads,
        joint_attention_dim=spec.t5_width,
        pooled_projection_dim=spec.clip_hidden,
        guidance_embeds=spec.guidance_embeds,
        axes_dims_rope=list(spec.rope_axes),
    )
    vae = _tiny_vae(
        spec.latent_channels,
        spec.vae_width,
        spec.vae_blocks,
        scaling=VAE_SCALING_FACTOR,
        shift=VAE_SHIFT_FACTOR,
    )
    scheduler = DEV_SCHEDULER if spec.guidance_embeds else SCHNELL_SCHEDULER
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**scheduler),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=clip_tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=t5_tokenizer,
        transformer=transformer,
    )


def save_tiny_flux_pipeline(
    directory: str | Path, spec: TinyFluxSpec = TinyFluxSpec(), words: tuple[str, ...] = ()
) -> Path:
    """Build a tiny FLUX pipeline and ``save_pretrained`` it (safetensors) to ``directory``."""
    directory = Path(directory)
    build_tiny_flux_pipeline(spec, words).save_pretrained(directory)
    return directory


__all__ = [
    "DEV_SCHEDULER",
    "SCHNELL_SCHEDULER",
    "TinyFluxSpec",
    "build_tiny_flux_pipeline",
    "save_tiny_flux_pipeline",
]
