"""Qwen-Image: a Qwen2.5-VL text encoder, packed 2x2 latent patches, a video VAE, true CFG.

Outside ``model/`` its latents are unpacked [B, C, h, w] (C = the VAE's ``z_dim``, the
frame axis of the video VAE dropped); they are packed into [B, h/2 * w/2, 4C] tokens
only for the transformer, with ``QwenImagePipeline``'s own packing, and given the frame
axis back only for decoding. Packing permutes elements, so the samplers' per-element
statistics (SDE log-probabilities averaged over C x h x w) are unchanged by it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from mogradient_diffusion.model.embeddings import PromptEmbeddings
from mogradient_diffusion.model.families.base import Family, check_resolution

PATCH = 2  # QwenImagePipeline packs 2x2 latent patches into one token


class QwenImage(Family):
    """``QwenImagePipeline``: timestep = sigma, a text token mask, no embedded guidance."""

    name = "qwen_image"
    pipeline_class_name = "QwenImagePipeline"
    # Flow-GRPO's Qwen-Image targets (scripts/train_qwenimage.py, there as attn.to_q, ...;
    # bare names match the same modules) and VeRL-Omni's (examples/flowgrpo_trainer/
    # qwen_image/run_qwen_image_ocr_lora.sh): the joint attention's projections and both
    # streams' MLPs.
    lora_targets = (
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "add_q_proj",
        "add_k_proj",
        "add_v_proj",
        "to_add_out",
        "img_mlp.net.0.proj",
        "img_mlp.net.2",
        "txt_mlp.net.0.proj",
        "txt_mlp.net.2",
    )
    # QwenImagePipeline guides only when given a negative prompt; its documentation and
    # Flow-GRPO's Qwen-Image trainer use a single space.
    negative_prompt = " "

    def lora_excluded(self, transformer: nn.Module) -> tuple[str, ...]:
        """The last block's text-stream output layers: its text tokens are discarded."""
        last = f"transformer_blocks.{len(transformer.transformer_blocks) - 1}"
        return tuple(
            name
            for name, module in transformer.named_modules()
            if isinstance(module, nn.Linear)
            and (name == f"{last}.attn.to_add_out" or name.startswith(f"{last}.txt_mlp."))
        )

    def encode_prompts(
        self, pipeline: Any, prompts: Sequence[str], max_sequence_length: int
    ) -> PromptEmbeddings:
        embeds, mask = pipeline.encode_prompt(
            prompt=list(prompts),
            device=pipeline.transformer.device,
            max_sequence_length=max_sequence_length,
        )
        if mask is None:  # the pipeline drops a mask of all ones; CFG stacks rows of any length
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return PromptEmbeddings(embeds, mask=mask)

    def velocity(
        self,
        denoiser: nn.Module,
        latents: torch.Tensor,
        sigmas: torch.Tensor,
        embeds: PromptEmbeddings,
        guidance: float | None = None,
    ) -> torch.Tensor:
        batch, _, height, width = latents.shape
        mask = embeds.mask
        if mask is not None and bool(mask.all()):
            mask = None  # as the pipeline calls it when no token is padding
        packed = denoiser(
            hidden_states=self._pack(latents),
            timestep=sigmas,
            encoder_hidden_states=embeds.prompt_embeds,
            encoder_hidden_states_mask=mask,
            img_shapes=[[(1, height // PATCH, width // PATCH)]] * batch,
            guidance=None,
            return_dict=False,
        )[0]
        return self._unpack(packed, height, width)

    def pipeline_guidance(
        self, pipeline: Any, guidance_scale: float, guidance: float | None, rows: int
    ) -> dict[str, Any]:
        """QwenImagePipeline guides through ``true_cfg_scale`` against a negative prompt (its
        default 4.0 applies only when a negative prompt is given): the rollout's negative."""
        self.check_guidance(pipeline, guidance)
        options: dict[str, Any] = {"true_cfg_scale": guidance_scale}
        if guidance_scale != 1.0:
            options["negative_prompt"] = [self.negative_prompt] * rows
        return options

    def combine_guidance(
        self, uncond: torch.Tensor, cond: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """CFG rescaled to the conditional velocity's norm, per token over its packed
        channels, as ``QwenImagePipeline`` guides."""
        _, _, height, width = cond.shape
        cond, uncond = self._pack(cond), self._pack(uncond)
        combined = uncond + scale * (cond - uncond)
        rescaled = combined * (
            cond.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True)
        )
        return self._unpack(rescaled, height, width)

    def decode(self, pipeline: Any, latents: torch.Tensor) -> torch.Tensor:
        vae = pipeline.vae
        shape = (1, vae.config.z_dim, 1, 1, 1)
        frames = latents.unsqueeze(2).to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(frames.device, frames.dtype)
        # the pipeline divides by the reciprocal std; kept, so decoding rounds as it does
        inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(
            frames.device, frames.dtype
        )
        return vae.decode(frames / inverse_std + mean, return_dict=False)[0][:, :, 0]

    def latent_shape(self, pipeline: Any, resolution: int) -> tuple[int, int, int]:
        check_resolution(resolution, pipeline.vae_scale_factor * PATCH)
        size = resolution // pipeline.vae_scale_factor
        return (pipeline.transformer.config.in_channels // PATCH**2, size, size)

    def sigmas(
        self, pipeline: Any, steps: int, resolution: int, shift: float | None = None
    ) -> torch.Tensor:
        """The pipeline's schedule, computed by a copy of its scheduler: sigmas from 1 to
        1/steps, shifted by mu (from the image's token count and the scheduler config),
        the last stretched to ``shift_terminal``. ``shift`` replaces mu by that static shift."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        config = pipeline.scheduler.config
        if shift is None:
            scheduler = type(pipeline.scheduler).from_config(config)
            _, height, width = self.latent_shape(pipeline, resolution)
            mu = calculate_shift(
                (height // PATCH) * (width // PATCH),
                config.get("base_image_seq_len", 256),
                config.get("max_image_seq_len", 4096),
                config.get("base_shift", 0.5),
                config.get("max_shift", 1.15),
            )
        else:
            scheduler = type(pipeline.scheduler).from_config(
                config, use_dynamic_shifting=False, shift=shift
            )
            mu = None
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        return scheduler.sigmas.float().cpu()

    def _pack(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, C, h, w] -> [B, h/2 * w/2, 4C] tokens of 2x2 patches."""
        batch, channels, height, width = latents.shape
        return self.pipeline_class()._pack_latents(latents, batch, channels, height, width)

    def _unpack(self, packed: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """[B, h/2 * w/2, 4C] tokens -> [B, C, h, w] (sizes in latent pixels: scale factor 1)."""
        return self.pipeline_class()._unpack_latents(packed, height, width, 1)[:, :, 0]


__all__ = ["QwenImage"]
