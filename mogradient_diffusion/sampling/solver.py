"""SDE rollouts that record what likelihood-ratio objectives train on (Flow-GRPO, SDPO).

A trajectory runs the flow from noise to data with the SDE step of ``sde`` on the
``sde_steps`` and the deterministic Euler step elsewhere (Flow-GRPO-Fast's window: the
ODE steps have no density and are not trained). For each ``recorded_steps`` entry it keeps
x_t, x_next and log p_old(x_next | x_t); optionally the predicted clean sample
x0_hat = x_t - t v at every step (SDPO's dense rewards). SDPO's pairs are rows that share
x_T and draw their own per-step noise: :func:`paired_noise` builds them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from mogradient_diffusion.policy import Policy, PromptEmbeddings
from mogradient_diffusion.rollout import sampler_sigmas
from mogradient_diffusion.sde import gaussian_log_prob, sde_sample, sde_step_statistics

if TYPE_CHECKING:
    from mogradient_diffusion.objectives.base import RolloutRequest

VelocityFn = Callable[[Tensor, Tensor], Tensor]


@dataclass
class SDETrajectories:
    """Per-sample trajectories; S recorded steps, T sampling steps.

    latents, next_latents: [B, S, C, H, W] x_t and x_next of each recorded step.
    log_probs: [B, S] float32 log p_old(x_next | x_t), averaged over C x H x W.
    steps: [S] schedule indices of the recorded steps (0 is the noisiest).
    sigmas: [T + 1] the schedule.
    final: [B, C, H, W] the sampled clean latents.
    predicted_x0: [B, T, C, H, W] x_t - t v at every step, or None when not asked for.
    """

    latents: Tensor
    next_latents: Tensor
    log_probs: Tensor
    steps: Tensor
    sigmas: Tensor
    final: Tensor
    predicted_x0: Tensor | None = None


@dataclass
class SampledRequest:
    """A rollout request sampled with the ``old`` adapter: trajectories and their conditioning.

    ``embeds`` and ``negative`` (CFG's unconditional rows, None without CFG) hold one row
    per sample; the training forward must use the same ones to reproduce log p_old.
    """

    trajectories: SDETrajectories
    embeds: PromptEmbeddings
    negative: PromptEmbeddings | None
    images: Tensor
    prompts: list[str]
    metadata: list[dict]
    group_ids: Tensor


def sample_request(
    policy: Policy,
    request: RolloutRequest,
    noise: Tensor,
    eta: float,
    sde_steps: Sequence[int],
    recorded_steps: Sequence[int],
    record_x0: bool = False,
) -> SampledRequest:
    """Sample ``request`` from x_T = ``noise`` (one row per image) in chunks of the rollout
    batch size, per-step noise drawn from the request's generator, without gradients.

    ``request.on_images`` gets each chunk's decoded final images as soon as they exist.
    """
    settings = request.settings
    per_image = settings.images_per_prompt
    total = len(request.prompts) * per_image
    shape = (total, *policy.latent_shape(settings.resolution))
    if tuple(noise.shape) != shape:
        raise ValueError(f"noise must have shape {shape}, got {tuple(noise.shape)}")
    sigmas = sampler_sigmas(settings.steps, policy.pipeline.scheduler.config.shift)
    length = settings.max_sequence_length
    embeds = policy.encode_prompts(request.prompts, length).repeat_interleave(per_image)
    negative = None
    if settings.guidance_scale != 1.0:
        negative = policy.encode_prompts([""], length).repeat_interleave(total)
    chunk = settings.batch_size or total
    parts, images = [], []
    with torch.no_grad():
        for start in range(0, total, chunk):
            rows = slice(start, start + chunk)
            uncond = None if negative is None else negative.index(rows)
            velocity = guided_velocity(
                policy, embeds.index(rows), uncond, settings.guidance_scale, "old"
            )
            part = sample_sde(
                velocity,
                noise[rows].to(policy.device),
                sigmas,
                eta,
                sde_steps,
                recorded_steps,
                request.generator,
                record_x0,
            )
            parts.append(part)
            images.append(policy.decode(part.final))
            if request.on_images is not None:
                request.on_images(rows, images[-1])
    return SampledRequest(
        trajectories=_concatenate(parts),
        embeds=embeds,
        negative=negative,
        images=torch.cat(images),
        prompts=[p for p in request.prompts for _ in range(per_image)],
        metadata=[m for m in request.metadata for _ in range(per_image)],
        group_ids=torch.arange(len(request.prompts)).repeat_interleave(per_image),
    )


def _concatenate(parts: list[SDETrajectories]) -> SDETrajectories:
    """Chunks of one rollout (same steps and schedule) as one batch."""

    def cat(name: str) -> Tensor | None:
        values = [getattr(part, name) for part in parts]
        return None if values[0] is None else torch.cat(values)

    return SDETrajectories(
        latents=cat("latents"),
        next_latents=cat("next_latents"),
        log_probs=cat("log_probs"),
        steps=parts[0].steps,
        sigmas=parts[0].sigmas,
        final=cat("final"),
        predicted_x0=cat("predicted_x0"),
    )


def flow_grpo_steps(
    num_steps: int,
    timestep_fraction: float = 0.99,
    window_size: int | None = None,
    window_range: tuple[int, int] = (0, 5),
    generator: torch.Generator | None = None,
) -> tuple[list[int], list[int]]:
    """(SDE steps, trained steps) of one Flow-GRPO rollout.

    Without a window every step is an SDE step and steps 0 .. floor(T f) - 1 are trained
    (the last one's Gaussian is too sharp to train on). With ``window_size`` w (Fast),
    a window [s, s + w) with s uniform in [lo, hi - w] is drawn from ``generator``: only
    those steps are SDE steps, and all of them are trained.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if window_size is None:
        if not 0.0 < timestep_fraction <= 1.0:
            raise ValueError(f"timestep_fraction must lie in (0, 1], got {timestep_fraction}")
        trained = int(num_steps * timestep_fraction)
        if trained < 1:
            raise ValueError(
                f"timestep_fraction {timestep_fraction} of {num_steps} steps trains no step; "
                "raise it or the number of steps"
            )
        return list(range(num_steps)), list(range(trained))
    low, high = window_range
    if not (window_size >= 1 and low >= 0 and low + window_size <= high <= num_steps):
        raise ValueError(
            f"window_size {window_size} must fit in window_range {window_range} within "
            f"{num_steps} steps (0 <= lo, lo + w <= hi <= steps)"
        )
    start = int(torch.randint(low, high - window_size + 1, (1,), generator=generator).item())
    window = list(range(start, start + window_size))
    return window, window


def sample_sde(
    velocity: VelocityFn,
    noise: Tensor,
    sigmas: Tensor,
    eta: float,
    sde_steps: Sequence[int],
    recorded_steps: Sequence[int],
    generator: torch.Generator | None = None,
    record_x0: bool = False,
) -> SDETrajectories:
    """Sample from x_T = ``noise`` along ``sigmas``; SDE on ``sde_steps``, Euler elsewhere.

    ``velocity(x, sigma)`` gets the state and a [B] float32 noise level and returns v (no
    grad needed). ``recorded_steps`` must be SDE steps (none: plain sampling, where eta = 0
    is the Euler sampler). Latents are [B, C, H, W]; the state is kept in float32.
    """
    levels = sigmas.detach().float().cpu()
    num_steps = len(levels) - 1
    _check_steps(num_steps, sde_steps, recorded_steps, eta)
    sde_set, recorded = set(sde_steps), sorted(recorded_steps)
    x = noise.float()
    sigma_max = float(levels[1])  # stands in for t at t = 1 (0 for a single step)
    kept: dict[str, list[Tensor]] = {"latents": [], "next": [], "log_probs": []}
    x0_hats = []
    for i in range(num_steps):
        sigma = levels[i].expand(len(x)).to(x.device)
        sigma_next = levels[i + 1].expand(len(x)).to(x.device)
        with torch.no_grad():
            v = velocity(x, sigma).float()
        if record_x0:
            x0_hats.append(x - sigma.reshape(-1, *[1] * (x.ndim - 1)) * v)
        if i in sde_set:
            mean, std, _ = sde_step_statistics(x, v, sigma, sigma_next, sigma_max, eta)
            x_next = sde_sample(mean, std, generator)
        else:
            x_next = x + (sigma_next - sigma).reshape(-1, *[1] * (x.ndim - 1)) * v
        if i in recorded:
            kept["latents"].append(x)
            kept["next"].append(x_next)
            kept["log_probs"].append(gaussian_log_prob(x_next, mean, std))
        x = x_next
    return SDETrajectories(
        latents=_stack_steps(kept["latents"], x),
        next_latents=_stack_steps(kept["next"], x),
        log_probs=_stack_steps(kept["log_probs"], x[:, 0, 0, 0]).float(),
        steps=torch.tensor(recorded, dtype=torch.long),
        sigmas=levels,
        final=x,
        predicted_x0=torch.stack(x0_hats, dim=1) if record_x0 else None,
    )


def _stack_steps(values: list[Tensor], like: Tensor) -> Tensor:
    """[B, S, ...] from S tensors shaped like ``like``; S may be 0."""
    if not values:
        return like.new_zeros(len(like), 0, *like.shape[1:])
    return torch.stack(values, dim=1)


def paired_noise(noise: Tensor) -> Tensor:
    """x_T for SDPO's pairs: each row of ``noise`` twice in a row (rows 2p and 2p + 1 share it)."""
    return noise.repeat_interleave(2, dim=0)


def guided_velocity(
    policy: Policy,
    embeds: PromptEmbeddings,
    negative: PromptEmbeddings | None,
    guidance_scale: float,
    adapter: str,
    detach_uncond: bool = False,
) -> VelocityFn:
    """v(x, sigma) of ``adapter`` with CFG v_u + w (v_c - v_u) when ``negative`` is given.

    ``detach_uncond`` stops gradients through the unconditional branch (Flow-GRPO's July
    2025 code); the value is unchanged, so log p_old recomputed with it still matches.
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
        return uncond + guidance_scale * (cond - uncond)

    return velocity


def _at_least_float32(values: Tensor) -> Tensor:
    """Half-precision model outputs in float32 (the SDE step overflows in bf16), wider kept."""
    return values.to(torch.promote_types(values.dtype, torch.float32))


def _check_steps(
    num_steps: int, sde_steps: Sequence[int], recorded_steps: Sequence[int], eta: float
) -> None:
    if num_steps < 1:
        raise ValueError("sigmas must hold at least two levels (one step)")
    outside = [i for i in sde_steps if not 0 <= i < num_steps]
    if outside:
        raise ValueError(f"sde_steps {outside} are outside the {num_steps} sampling steps")
    not_sde = sorted(set(recorded_steps) - set(sde_steps))
    if not_sde:
        raise ValueError(
            f"recorded steps {not_sde} are not SDE steps: an ODE step has no log-probability"
        )
    if recorded_steps and eta <= 0:
        raise ValueError(f"eta must be > 0 for SDE steps with a log-probability, got {eta}")


__all__ = [
    "SDETrajectories",
    "SampledRequest",
    "flow_grpo_steps",
    "guided_velocity",
    "paired_noise",
    "sample_request",
    "sample_sde",
]
