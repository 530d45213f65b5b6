"""Stable Diffusion 3 and 3.5 (Medium, Large): CLIP-L, CLIP-G and T5, a static time shift."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mogradient_diffusion.model.embeddings import PromptEmbeddings
from mogradient_diffusion.model.families.base import Family, check_resolution
from mogradient_diffusion.model.schedules import NUM_TRAIN_TIMESTEPS, sampler_sigmas


class SD3(Family):
    """``StableDiffusion3Pipeline``: unpacked latents, timesteps in units of 1000, CFG."""

    name = "sd3"
    pipeline_class_name = "StableDiffusion3Pipeline"
    # Bare names also match the second attention (attn2) of SD3.5's dual-attention blocks.
    lora_targets = (
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "add_q_proj",
        "add_k_proj",
        "add_v_proj",
        "to_add_out",
    )

    def encode_prompts(
        self, pipeline: Any, prompts: Sequence[str], max_sequence_length: int
    ) -> PromptEmbeddings:
        embeds, _, pooled, _ = pipeline.encode_prompt(
            prompt=list(prompts),
            prompt_2=None,
            prompt_3=None,
            device=pipeline.transformer.device,
            do_classifier_free_guidance=False,
            max_sequence_length=max_sequence_length,
        )
        return PromptEmbeddings(embeds, pooled)

    def velocity(
        self,
        denoiser: nn.Module,
        latents: torch.Tensor,
        sigmas: torch.Tensor,
        embeds: PromptEmbeddings,
        guidance: float | None = None,
    ) -> torch.Tensor:
        return denoiser(
            hidden_states=latents,
            encoder_hidden_states=embeds.prompt_embeds,
            pooled_projections=embeds.pooled,
            timestep=sigmas * NUM_TRAIN_TIMESTEPS,
            return_dict=False,
        )[0]

    def decode(self, pipeline: Any, latents: torch.Tensor) -> torch.Tensor:
        vae = pipeline.vae
        scaled = latents / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
        return vae.decode(scaled.to(vae.dtype), return_dict=False)[0]

    def latent_shape(self, pipeline: Any, resolution: int) -> tuple[int, int, int]:
        check_resolution(
            resolution, pipeline.vae_scale_factor * pipeline.transformer.config.patch_size
        )
        size = resolution // pipeline.vae_scale_factor
        return (pipeline.transformer.config.in_channels, size, size)

    def sigmas(
        self, pipeline: Any, steps: int, resolution: int, shift: float | None = None
    ) -> torch.Tensor:
        return sampler_sigmas(steps, pipeline.scheduler.config.shift if shift is None else shift)


__all__ = ["SD3"]
