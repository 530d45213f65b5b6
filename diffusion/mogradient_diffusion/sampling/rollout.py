"""Rollouts: groups of images per prompt, sampled in chunks with CFG and decoded as they finish.

The one sampler every objective uses. DiffusionNFT needs only the clean final latents
(and the images for the rewards), so any solver works; the references use a
deterministic one (Euler for evaluation, multistep DPM-Solver++(2M), the ``dpm2`` sampler,
for training rollouts: the SD3.5-M recipes set ``rollout.sampler: dpm2``).
Flow-GRPO and SDPO sample the SDE and keep the per-step states and log-probs
[`integrate`][mogradient_diffusion.sampling.solver.integrate] records. Flow matching
convention: x_t = (1 - t) x0 + t noise, velocity v = noise - x0, sampled from t = 1 down
to 0 on the model family's schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from tqdm.auto import tqdm

from mogradient_diffusion.model.embeddings import PromptEmbeddings
from mogradient_diffusion.model.policy import ADAPTERS, Policy
from mogradient_diffusion.sampling.solver import (
    SAMPLERS,
    Trajectories,
    VelocityFn,
    concatenate,
    integrate,
)


@dataclass
class RolloutBatch:
    """prompts x images_per_prompt samples; a prompt's rows are adjacent and share a group id.

    ``embeds`` and ``negative`` (CFG's unconditional rows, None without CFG) hold one row
    per sample: a training forward that must reproduce the sampler's velocity (log p_old)
    uses the same ones. ``sigmas`` [T + 1] is the schedule; ``trajectories`` the final
    latents and what the sampler recorded of its steps.
    """

    prompts: list[str]
    group_ids: Tensor
    embeds: PromptEmbeddings
    negative: PromptEmbeddings | None
    images: Tensor
    sigmas: Tensor
    trajectories: Trajectories

    @property
    def latents(self) -> Tensor:
        """[B, C, H, W] the sampled clean latents."""
        return self.trajectories.final

    def __len__(self) -> int:
        return len(self.prompts)


def rollout(
    policy: Policy,
    prompts: list[str],
    images_per_prompt: int,
    steps: int,
    *,
    resolution: int = 512,
    guidance_scale: float = 1.0,
    sampler: str = "euler",
    noise_level: float = 0.7,
    sde_steps: Sequence[int] | None = None,
    recorded_steps: Sequence[int] = (),
    record_x0: bool = False,
    generator: torch.Generator | None = None,
    adapter: str = "old",
    negative_embeds: PromptEmbeddings | None = None,
    noise: Tensor | None = None,
    batch_size: int | None = None,
    shift: float | None = None,
    max_sequence_length: int = 256,
    progress: bool = False,
    on_images: Callable[[slice, Tensor], object] | None = None,
) -> RolloutBatch:
    """Sample ``images_per_prompt`` images for each prompt with ``adapter``'s velocity, no grad.

    ``guidance_scale != 1`` turns on CFG against ``negative_embeds`` (one row, or one per
    image; the family's negative prompt by default). ``noise`` [B, C, h, w] replaces noise
    drawn from ``generator``. ``batch_size`` images go through the sampler at a time;
    deterministic samplers give the same images for any ``batch_size``. ``shift`` overrides
    the family schedule's time shift. ``sampler``, ``noise_level`` (the SDE's eta),
    ``sde_steps``, ``recorded_steps`` and ``record_x0`` are
    [`integrate`][mogradient_diffusion.sampling.solver.integrate]'s; the SDE's per-step noise
    comes from ``generator`` too. ``on_images`` is called with each chunk's rows and
    decoded images as soon as they exist, so rewards can score them while the next chunk
    samples.
    """
    _check_rollout_args(prompts, images_per_prompt, sampler, adapter, noise_level, batch_size)
    sigmas = policy.sigmas(steps, resolution, shift)
    total = len(prompts) * images_per_prompt
    noise = _initial_noise(policy, total, resolution, generator, noise)
    embeds = policy.encode_prompts(prompts, max_sequence_length)
    embeds = embeds.repeat_interleave(images_per_prompt)
    negative = _negative_rows(policy, guidance_scale, negative_embeds, total, max_sequence_length)
    chunk = batch_size or total
    parts, images = [], []
    with (
        torch.no_grad(),
        policy.use_adapter(adapter),
        tqdm(total=-(-total // chunk) * steps, desc="rollout", disable=not progress) as bar,
    ):
        for start in range(0, total, chunk):
            rows = slice(start, start + chunk)
            uncond = None if negative is None else negative.index(rows)
            velocity = guided_velocity(policy, embeds.index(rows), uncond, guidance_scale, adapter)
            part = integrate(
                velocity,
                noise[rows],
                sigmas,
                sampler,
                noise_level,
                generator,
                sde_steps=sde_steps,
                recorded_steps=recorded_steps,
                record_x0=record_x0,
                on_step=bar.update,
            )
            parts.append(part)
            images.append(policy.decode(part.final))
            if on_images is not None:
                on_images(rows, images[-1])
    return RolloutBatch(
        prompts=[p for p in prompts for _ in range(images_per_prompt)],
        group_ids=torch.arange(len(prompts)).repeat_interleave(images_per_prompt),
        embeds=embeds,
        negative=negative,
        images=torch.cat(images),
        sigmas=sigmas,
        trajectories=concatenate(parts),
    )


def guided_velocity(
    policy: Policy,
    embeds: PromptEmbeddings,
    negative: PromptEmbeddings | None,
    guidance_scale: float,
    adapter: str,
    detach_uncond: bool = False,
) -> VelocityFn:
    """v(x, sigma) of ``adapter`` with CFG v_u + w (v_c - v_u) when ``negative`` is given.

    Both halves of CFG go through one batched forward. ``detach_uncond`` stops gradients
    through the unconditional branch (Flow-GRPO's July 2025 code); the value is
    unchanged, so log p_old recomputed with it still matches.
    """

    def velocity(x: Tensor, sigma: Tensor) -> Tensor:
        x = x.to(policy.dtype)
        if negative is None:
            return _at_least_float32(policy.velocity(x, sigma, embeds, adapter))
        both = PromptEmbeddings.cat([negative, embeds])
        out = policy.velocity(torch.cat([x, x]), torch.cat([sigma, sigma]), both, adapter)
        uncond, cond = _at_least_float32(out).chunk(2)
        if detach_uncond:
            uncond = uncond.detach()
        return policy.family.combine_guidance(uncond, cond, guidance_scale)

    return velocity


def _at_least_float32(values: Tensor) -> Tensor:
    """Half-precision model outputs in float32 (the SDE step overflows in bf16), wider kept."""
    return values.to(torch.promote_types(values.dtype, torch.float32))


def paired_noise(noise: Tensor) -> Tensor:
    """x_T for SDPO's pairs: each row of ``noise`` twice in a row (rows 2p and 2p + 1 share it)."""
    return noise.repeat_interleave(2, dim=0)


def _negative_rows(
    policy: Policy,
    guidance_scale: float,
    negative: PromptEmbeddings | None,
    total: int,
    max_sequence_length: int,
) -> PromptEmbeddings | None:
    """Per-image unconditional embeddings for CFG, or None when CFG is off."""
    if guidance_scale == 1.0:
        return None
    if negative is None:
        negative = policy.encode_prompts([policy.family.negative_prompt], max_sequence_length)
    if len(negative) == 1:
        negative = negative.repeat_interleave(total)
    if len(negative) != total:
        raise ValueError(f"negative_embeds needs 1 or {total} rows, got {len(negative)}")
    return negative.to(policy.device, policy.dtype)


def _initial_noise(
    policy: Policy,
    total: int,
    resolution: int,
    generator: torch.Generator | None,
    noise: Tensor | None,
) -> Tensor:
    """Noise for all images at once, so that chunking does not change which image gets which."""
    shape = (total, *policy.latent_shape(resolution))
    if noise is None:
        device = generator.device if generator is not None else policy.device
        noise = torch.randn(shape, generator=generator, device=device)
    if tuple(noise.shape) != shape:
        raise ValueError(f"noise must have shape {shape}, got {tuple(noise.shape)}")
    return noise.to(policy.device, torch.float32)


def _check_rollout_args(
    prompts: list[str],
    images_per_prompt: int,
    sampler: str,
    adapter: str,
    noise_level: float,
    batch_size: int | None,
) -> None:
    if isinstance(prompts, str) or not prompts:
        raise ValueError("prompts must be a non-empty list of strings")
    if images_per_prompt < 1:
        raise ValueError(f"images_per_prompt must be >= 1, got {images_per_prompt}")
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
    if adapter not in ADAPTERS:
        raise ValueError(f"adapter must be one of {ADAPTERS}, got {adapter!r}")
    if noise_level < 0:
        raise ValueError(f"noise_level must be >= 0, got {noise_level}")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")


__all__ = ["RolloutBatch", "guided_velocity", "paired_noise", "rollout"]
