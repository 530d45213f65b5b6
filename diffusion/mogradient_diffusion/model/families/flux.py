"""FLUX.1 (dev, schnell): CLIP pooled and T5 conditioning, 2x2-packed latents, dynamic shift.

The transformer takes packed tokens [B, (h/2)(w/2), 4C] with position ids; the rest of
the trainer keeps the latents unpacked [B, C, h, w]. Packing is a permutation of the
elements, so the SDE's per-element means and log-probabilities are the same either way.
FLUX.1-dev is guidance-distilled: its embedded guidance is one more transformer input,
not classifier-free guidance; schnell has none.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from mogradient_diffusion.model.embeddings import PromptEmbeddings
from mogradient_diffusion.model.families.base import Family, UnsupportedGuidance, check_resolution

# FluxPipeline's default guidance_scale, which FLUX.1-dev was distilled around.
DEFAULT_GUIDANCE = 3.5


class Flux(Family):
    """``FluxPipeline``: packed latents, timesteps as sigma, embedded guidance on dev."""

    name = "flux"
    pipeline_class_name = "FluxPipeline"
    # Flow-GRPO's FLUX.1-dev list (scripts/train_flux.py): the dual blocks' attention and
    # both feed-forwards; by suffix the attn.to_q/k/v names also reach the single blocks.
    lora_targets = (
        "attn.to_k",
        "attn.to_q",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_k_proj",
        "attn.add_q_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
    )

    def encode_prompts(
        self, pipeline: Any, prompts: Sequence[str], max_sequence_length: int
    ) -> PromptEmbeddings:
        embeds, pooled, _ = pipeline.encode_prompt(
            prompt=list(prompts),
            prompt_2=None,
            device=pipeline.transformer.device,
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
        from diffusers import FluxPipeline

        batch, channels, height, width = latents.shape
        packed = FluxPipeline._pack_latents(latents, batch, channels, height, width)
        image_ids = FluxPipeline._prepare_latent_image_ids(
            batch, height // 2, width // 2, latents.device, latents.dtype
        )
        text_ids = latents.new_zeros(embeds.prompt_embeds.shape[1], 3)
        if _transformer(denoiser).config.guidance_embeds:
            value = DEFAULT_GUIDANCE if guidance is None else guidance
            embedded = torch.full((batch,), value, device=latents.device, dtype=torch.float32)
        else:
            embedded = None
        packed_velocity = denoiser(
            hidden_states=packed,
            encoder_hidden_states=embeds.prompt_embeds,
            pooled_projections=embeds.pooled,
            timestep=sigmas,  # the transformer multiplies by 1000 itself
            img_ids=image_ids,
            txt_ids=text_ids,
            guidance=embedded,
            return_dict=False,
        )[0]
        # _unpack_latents reads sizes in pixels; with a scale factor of 1 they are latents'.
        return FluxPipeline._unpack_latents(packed_velocity, height, width, 1)

    def check_guidance(self, pipeline: Any, guidance: float | None) -> None:
        """FLUX.1-dev takes any embedded guidance; schnell (no guidance embedding) none."""
        if guidance is not None and not pipeline.transformer.config.guidance_embeds:
            raise UnsupportedGuidance(
                f"model.guidance={guidance} but this FLUX model has no guidance embedding "
                "(FLUX.1-schnell): leave it unset (rollout.guidance_scale sets "
                "classifier-free guidance)"
            )

    def pipeline_guidance(
        self, pipeline: Any, guidance_scale: float, guidance: float | None, rows: int
    ) -> dict[str, Any]:
        """FluxPipeline's ``guidance_scale`` is the embedded guidance (ignored by schnell);
        classifier-free guidance is its ``true_cfg_scale`` with a negative prompt."""
        self.check_guidance(pipeline, guidance)
        options: dict[str, Any] = {
            "guidance_scale": DEFAULT_GUIDANCE if guidance is None else guidance
        }
        if guidance_scale != 1.0:
            options.update(true_cfg_scale=guidance_scale, negative_prompt=[""] * rows)
        return options

    def decode(self, pipeline: Any, latents: torch.Tensor) -> torch.Tensor:
        vae = pipeline.vae
        scaled = latents / vae.config.scaling_factor + vae.config.shift_factor
        return vae.decode(scaled.to(vae.dtype), return_dict=False)[0]

    def latent_shape(self, pipeline: Any, resolution: int) -> tuple[int, int, int]:
        # Latents are packed in 2x2 patches, so the image tiles in 2 * vae_scale_factor.
        check_resolution(resolution, 2 * pipeline.vae_scale_factor)
        size = resolution // pipeline.vae_scale_factor
        return (pipeline.transformer.config.in_channels // 4, size, size)

    def sigmas(
        self, pipeline: Any, steps: int, resolution: int, shift: float | None = None
    ) -> torch.Tensor:
        """FluxPipeline's schedule: linspace(1, 1/N, N) through a copy of its scheduler, with
        the shift mu that the number of image tokens sets when shifting is dynamic."""
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        config = pipeline.scheduler.config
        if shift is not None and config.get("use_dynamic_shifting"):
            raise ValueError(
                f"shift={shift} does not apply to this FLUX model: its scheduler shifts by "
                "the number of image tokens (use_dynamic_shifting), so the resolution sets it"
            )
        overrides = {} if shift is None else {"shift": shift}
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(config, **overrides)
        _, height, width = self.latent_shape(pipeline, resolution)
        mu = calculate_shift(
            (height // 2) * (width // 2),
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        sigmas = None if config.get("use_flow_sigmas") else np.linspace(1.0, 1 / steps, steps)
        retrieve_timesteps(scheduler, steps, "cpu", sigmas=sigmas, mu=mu)
        return scheduler.sigmas


def _transformer(denoiser: nn.Module) -> nn.Module:
    """The transformer itself when ``denoiser`` is a wrapper of it (DDP's ``module``)."""
    return getattr(denoiser, "module", denoiser)


__all__ = ["DEFAULT_GUIDANCE", "Flux"]
