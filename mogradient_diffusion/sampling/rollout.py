"""Rollouts: groups of images per prompt sampled from one of the policy's velocity fields.

DiffusionNFT only needs the clean final latents (and the images for the rewards), so any
solver works; the references use a deterministic one (Euler for evaluation, multistep
DPM-Solver-2 for training rollouts). Flow matching convention: x_t = (1 - t) x0 + t noise,
velocity v = noise - x0, sampled from t = 1 down to 0 on SD3's shifted schedule.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from mogradient_diffusion.policy import ADAPTERS, NUM_TRAIN_TIMESTEPS, Policy, PromptEmbeddings

SAMPLERS = ("euler", "dpm2", "sde")
VelocityFn = Callable[[torch.Tensor, float], torch.Tensor]


def sampler_sigmas(
    steps: int, shift: float = 3.0, num_train_timesteps: int = NUM_TRAIN_TIMESTEPS
) -> torch.Tensor:
    """Noise levels [steps + 1] from 1 to 0, equal to ``FlowMatchEulerDiscreteScheduler``'s.

    As in diffusers: t runs linearly from 1 to the scheduler's smallest training sigma
    (itself shifted, shift(1/1000)), is shifted t' = shift t / (1 + (shift - 1) t), and a
    final 0 is appended; so the last non-zero sigma is small (0.0089 at 4 steps, shift 3).
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    n = num_train_timesteps
    sigma_min = _shift(torch.tensor(1.0) / n, shift).item()  # computed in float32, as diffusers
    t = torch.linspace(n, sigma_min * n, steps, dtype=torch.float64) / n
    sigmas = _shift(t, shift).float()
    return torch.cat([sigmas, sigmas.new_zeros(1)])


def _shift(t: torch.Tensor, shift: float) -> torch.Tensor:
    return shift * t / (1 + (shift - 1) * t)


@dataclass
class RolloutBatch:
    """prompts x images_per_prompt samples; a prompt's rows are adjacent and share a group id."""

    prompts: list[str]
    group_ids: torch.Tensor
    embeds: PromptEmbeddings
    latents: torch.Tensor
    images: torch.Tensor
    sigmas: torch.Tensor

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
    generator: torch.Generator | None = None,
    adapter: str = "old",
    negative_embeds: PromptEmbeddings | None = None,
    noise: torch.Tensor | None = None,
    batch_size: int | None = None,
    shift: float | None = None,
    max_sequence_length: int = 256,
    progress: bool = False,
    on_images: Callable[[slice, torch.Tensor], object] | None = None,
) -> RolloutBatch:
    """Sample ``images_per_prompt`` images for each prompt with ``adapter``'s velocity, no grad.

    ``guidance_scale != 1`` turns on CFG against ``negative_embeds`` (one row, or one per
    image; the empty prompt by default). ``noise`` [B, C, h, w] replaces the initial noise
    drawn from ``generator``. ``batch_size`` images go through the sampler at a time;
    deterministic samplers give the same images for any ``batch_size``. ``shift`` defaults
    to the pipeline scheduler's. ``noise_level`` is the SDE sampler's eta. ``on_images``
    is called with each chunk's rows and decoded images as soon as they exist, so rewards
    can score them while the next chunk samples.
    """
    _check_rollout_args(prompts, images_per_prompt, sampler, adapter, noise_level, batch_size)
    if shift is None:
        shift = policy.pipeline.scheduler.config.shift
    sigmas = sampler_sigmas(steps, shift)
    total = len(prompts) * images_per_prompt
    noise = _initial_noise(policy, total, resolution, generator, noise)
    embeds = policy.encode_prompts(prompts, max_sequence_length)
    embeds = embeds.repeat_interleave(images_per_prompt)
    negative = _negative_rows(policy, guidance_scale, negative_embeds, total, max_sequence_length)
    chunk = batch_size or total
    latents, images = [], []
    with (
        torch.no_grad(),
        policy.use_adapter(adapter),
        tqdm(total=-(-total // chunk) * steps, desc="rollout", disable=not progress) as bar,
    ):
        for start in range(0, total, chunk):
            rows = slice(start, start + chunk)
            uncond = None if negative is None else negative.index(rows)
            v = _guided_velocity(policy, embeds.index(rows), uncond, guidance_scale, adapter)
            x0 = integrate(v, noise[rows], sigmas, sampler, noise_level, generator, bar.update)
            latents.append(x0)
            images.append(policy.decode(x0))
            if on_images is not None:
                on_images(rows, images[-1])
    return RolloutBatch(
        prompts=[p for p in prompts for _ in range(images_per_prompt)],
        group_ids=torch.arange(len(prompts)).repeat_interleave(images_per_prompt),
        embeds=embeds,
        latents=torch.cat(latents),
        images=torch.cat(images),
        sigmas=sigmas,
    )


def integrate(
    velocity: VelocityFn,
    latents: torch.Tensor,
    sigmas: torch.Tensor,
    sampler: str = "euler",
    noise_level: float = 0.7,
    generator: torch.Generator | None = None,
    on_step: Callable[[], object] | None = None,
) -> torch.Tensor:
    """Solve from ``latents`` at sigmas[0] down to sigmas[-1]; the state is kept in float32.

    ``velocity(x, sigma)`` returns v at a Python-float noise level. ``euler`` and ``dpm2``
    are deterministic; ``sde`` adds Flow-GRPO's noise (``noise_level`` = eta; 0 is Euler).
    """
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
    levels = sigmas.tolist()
    x = latents.float()
    previous_x0 = None
    for i in range(len(levels) - 1):
        v = velocity(x, levels[i]).float()
        if sampler == "euler":
            x = _euler_step(x, v, levels[i], levels[i + 1])
        elif sampler == "dpm2":
            x, previous_x0 = _dpm2_step(x, v, levels, i, previous_x0)
        else:
            x = _sde_step(x, v, levels, i, noise_level, generator)
        if on_step is not None:
            on_step()
    return x


def _euler_step(x: torch.Tensor, v: torch.Tensor, sigma: float, sigma_next: float) -> torch.Tensor:
    """x + (sigma_next - sigma) v; dt is rounded to float32 as the diffusers scheduler does."""
    dt = (torch.tensor(sigma_next) - torch.tensor(sigma)).item()
    return x + dt * v


def _dpm2_step(
    x: torch.Tensor, v: torch.Tensor, levels: list[float], i: int, previous_x0: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multistep DPM-Solver++(2M) in data prediction with alpha = 1 - sigma.

    The first-order update is exactly Euler. The second-order term needs finite log-SNRs
    on both sides, so the first two steps (sigma = 1 has log-SNR -inf) and the last step
    (to sigma = 0) are first order, which is also what the reference solver computes.
    """
    sigma, sigma_next = levels[i], levels[i + 1]
    x0 = x - sigma * v
    x_next = _euler_step(x, v, sigma, sigma_next)
    if previous_x0 is not None and sigma_next > 0 and levels[i - 1] < 1:
        h = _log_snr(sigma_next) - _log_snr(sigma)
        h_previous = _log_snr(sigma) - _log_snr(levels[i - 1])
        x_next = x_next + 0.5 * (1 - sigma_next / sigma) * (h / h_previous) * (x0 - previous_x0)
    return x_next, x0


def _log_snr(sigma: float) -> float:
    return math.log((1 - sigma) / sigma)


def _sde_step(
    x: torch.Tensor,
    v: torch.Tensor,
    levels: list[float],
    i: int,
    eta: float,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Flow-GRPO's Euler-Maruyama step of the marginal-preserving SDE with noise scale eta.

    std = eta sqrt(sigma / (1 - sigma)) (sigma = 1 uses the next level to stay finite).
    """
    sigma, sigma_next = levels[i], levels[i + 1]
    dt = sigma_next - sigma
    std = eta * math.sqrt(sigma / (1 - (levels[1] if sigma >= 1 else sigma)))
    mean = x * (1 + std**2 / (2 * sigma) * dt) + v * (1 + std**2 * (1 - sigma) / (2 * sigma)) * dt
    if std == 0:
        return mean
    return mean + std * math.sqrt(-dt) * _randn_like(x, generator)


def _randn_like(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Standard normal noise drawn on the generator's device (reproducible across devices)."""
    device = generator.device if generator is not None else x.device
    return torch.randn(x.shape, generator=generator, device=device).to(x.device)


def _guided_velocity(
    policy: Policy,
    embeds: PromptEmbeddings,
    negative: PromptEmbeddings | None,
    scale: float,
    adapter: str,
) -> VelocityFn:
    """v(x, sigma) of ``adapter``, with CFG (one batched forward) when ``negative`` is given."""

    def velocity(x: torch.Tensor, sigma: float) -> torch.Tensor:
        x = x.to(policy.dtype)
        if negative is None:
            return policy.velocity(x, sigma, embeds, adapter)
        both = PromptEmbeddings.cat([negative, embeds])
        uncond, cond = policy.velocity(torch.cat([x, x]), sigma, both, adapter).chunk(2)
        return uncond + scale * (cond - uncond)

    return velocity


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
        negative = policy.encode_prompts([""], max_sequence_length)
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
    noise: torch.Tensor | None,
) -> torch.Tensor:
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


__all__ = ["SAMPLERS", "RolloutBatch", "integrate", "rollout", "sampler_sigmas"]
