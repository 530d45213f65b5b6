"""What a model family supplies, so the rollout, objectives and trainer stay family-agnostic.

Everything outside ``model/`` sees latents as unpacked [B, C, h, w] tensors, noise levels
sigma in [0, 1] and [`PromptEmbeddings`][mogradient_diffusion.model.embeddings.PromptEmbeddings]. A
family turns those into its transformer's inputs (packing, position ids, timestep units,
guidance), its text encoders' outputs into embeddings, its VAE's latents into images,
and its scheduler's configuration into the noise levels a sampler runs through.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mogradient_diffusion.model.embeddings import PromptEmbeddings


class UnsupportedGuidance(ValueError):
    """``model.guidance`` was set for a model without embedded guidance."""


class Family(ABC):
    """One diffusers pipeline class and the conventions of its transformer."""

    name: str
    pipeline_class_name: str
    # The reference trainers' LoRA targets for this family (peft suffix matching).
    lora_targets: tuple[str, ...]
    # CFG's unconditional prompt when the caller gives none (the pipeline's convention).
    negative_prompt: str = ""

    def pipeline_class(self) -> type:
        import diffusers

        return getattr(diffusers, self.pipeline_class_name)

    def lora_excluded(self, transformer: nn.Module) -> tuple[str, ...]:
        """Full names of modules whose outputs never reach the velocity: a LoRA there would
        get no gradient (the trainer refuses parameters no objective reaches), so adapters
        skip them whatever the targets say. None by default."""
        return ()

    @abstractmethod
    def encode_prompts(
        self, pipeline: Any, prompts: Sequence[str], max_sequence_length: int
    ) -> PromptEmbeddings:
        """Text conditioning of ``prompts`` on the pipeline's device, without CFG rows."""

    @abstractmethod
    def velocity(
        self,
        denoiser: nn.Module,
        latents: torch.Tensor,
        sigmas: torch.Tensor,
        embeds: PromptEmbeddings,
        guidance: float | None = None,
    ) -> torch.Tensor:
        """The transformer's flow velocity for unpacked ``latents`` at ``sigmas`` [B].

        ``guidance`` is the embedded (distilled) guidance of families that have one
        (``model.guidance``); the others refuse it when the config is checked.
        """

    def check_guidance(self, pipeline: Any, guidance: float | None) -> None:
        """Refuse an embedded guidance the model cannot take (none, by default)."""
        if guidance is not None:
            raise UnsupportedGuidance(
                f"model.guidance={guidance} but {self.name} models have no embedded "
                "guidance: leave it unset (rollout.guidance_scale sets classifier-free "
                "guidance)"
            )

    def pipeline_guidance(
        self, pipeline: Any, guidance_scale: float, guidance: float | None, rows: int
    ) -> dict[str, Any]:
        """Keyword arguments that make ``pipeline(...)`` (``rows`` prompts) guide as the
        rollout does: CFG at ``guidance_scale`` against the empty prompt, and ``guidance``.

        By default the pipeline's ``guidance_scale`` is CFG with an empty negative prompt.
        """
        self.check_guidance(pipeline, guidance)
        return {"guidance_scale": guidance_scale}

    def combine_guidance(
        self, uncond: torch.Tensor, cond: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Classifier-free guidance of the two velocities (the family may rescale it)."""
        return uncond + scale * (cond - uncond)

    @abstractmethod
    def decode(self, pipeline: Any, latents: torch.Tensor) -> torch.Tensor:
        """Images [B, 3, H, W] in [-1, 1] from clean unpacked latents."""

    @abstractmethod
    def latent_shape(self, pipeline: Any, resolution: int) -> tuple[int, int, int]:
        """(channels, height, width) of the unpacked latents of a square image."""

    @abstractmethod
    def sigmas(
        self, pipeline: Any, steps: int, resolution: int, shift: float | None = None
    ) -> torch.Tensor:
        """Noise levels [steps + 1] from 1 to 0, as the family's own pipeline samples them."""


def check_resolution(resolution: int, factor: int) -> None:
    """A clear error for a resolution the VAE and the patching cannot tile."""
    if resolution <= 0 or resolution % factor:
        raise ValueError(f"resolution must be a positive multiple of {factor}, got {resolution}")
