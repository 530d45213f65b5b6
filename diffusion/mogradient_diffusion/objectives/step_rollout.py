"""Per-step SDE rollouts shared by the objectives that rescore transitions (Flow-GRPO, SDPO).

They sample a request with the ``old`` adapter through Flow-GRPO's SDE (the sampler of
``mogradient_diffusion.sampling``), keep x_t, x_next and log p_old of each trained step,
and at training time recompute the log-probability of the same transitions under the
trained adapter (and the step's mean under the base model, for a KL term), with the same
conditioning and CFG, so that r = 1 exactly before the policy moves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from mogradient_diffusion.config.settings import ConfigError
from mogradient_diffusion.model.embeddings import PromptEmbeddings
from mogradient_diffusion.model.policy import Policy
from mogradient_diffusion.objectives.base import RolloutRequest, StepMetrics
from mogradient_diffusion.sampling.rollout import RolloutBatch, guided_velocity, rollout
from mogradient_diffusion.sampling.sde import transition_log_prob

if TYPE_CHECKING:
    from mogradient_diffusion.config.settings import RolloutConfig, TrainConfig


@dataclass
class SampledRequest(RolloutBatch):
    """A request's rollout with each sample's metadata (the rewards SDPO queries on its
    x0 predictions need it)."""

    metadata: list[dict[str, Any]]


def sample_request(
    policy: Policy,
    request: RolloutRequest,
    noise: Tensor,
    eta: float,
    sde_steps: Sequence[int],
    recorded_steps: Sequence[int],
    record_x0: bool = False,
) -> SampledRequest:
    """Sample ``request`` with the ``old`` adapter from x_T = ``noise`` (one row per image):
    the SDE with noise level ``eta`` on ``sde_steps``, x_t, x_next and log p_old kept for
    ``recorded_steps``, per-step noise from the request's generator, without gradients."""
    settings = request.settings
    batch = rollout(
        policy,
        request.prompts,
        settings.images_per_prompt,
        settings.steps,
        resolution=settings.resolution,
        guidance_scale=settings.guidance_scale,
        sampler="sde",
        noise_level=eta,
        sde_steps=sde_steps,
        recorded_steps=recorded_steps,
        record_x0=record_x0,
        generator=request.generator,
        adapter="old",
        noise=noise,
        batch_size=settings.batch_size,
        max_sequence_length=settings.max_sequence_length,
        progress=request.progress,
        on_images=request.on_images,
    )
    per_image = settings.images_per_prompt
    metadata = [m for m in request.metadata for _ in range(per_image)]
    return SampledRequest(**vars(batch), metadata=metadata)


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


@dataclass(frozen=True)
class StepRollout:
    """Per-step SDE transitions of one rank's rollout: what likelihood-ratio losses rescore.

    Per sample: x_t and x_next [B, S, C, H, W] and log p_old [B, S] of the S recorded
    steps, with the conditioning (and CFG's unconditional rows) the sampler used. Shared:
    ``steps`` [S] (schedule indices), ``sigmas`` [T + 1], ``guidance_scale``.
    """

    prompts: list[str]
    group_ids: Tensor
    images: Tensor
    embeds: PromptEmbeddings
    negative: PromptEmbeddings | None
    latents: Tensor
    next_latents: Tensor
    log_probs: Tensor
    steps: Tensor
    sigmas: Tensor
    guidance_scale: float

    def __len__(self) -> int:
        return len(self.prompts)

    def rows(self, indices: Tensor) -> StepRollout:
        index = indices.tolist()
        return dataclasses.replace(
            self,
            prompts=[self.prompts[i] for i in index],
            group_ids=self.group_ids[indices],
            images=self.images[indices.to(self.images.device)],
            embeds=self.embeds.index(indices),
            negative=None if self.negative is None else self.negative.index(indices),
            latents=self.latents[indices.to(self.latents.device)],
            next_latents=self.next_latents[indices.to(self.next_latents.device)],
            log_probs=self.log_probs[indices.to(self.log_probs.device)],
        )


def rescore_step(
    policy: Policy,
    data: StepRollout,
    column: int,
    eta: float,
    detach_uncond: bool,
    adapter: str = "default",
) -> tuple[Tensor, Tensor, Tensor]:
    """(log p(x_next | x_t), mean, sigma_t) of recorded step ``column`` under ``adapter``.

    With ``default`` the log-probability is differentiable in the trained LoRA.
    """
    index = int(data.steps[column])
    count = len(data)
    level = data.sigmas[index].expand(count).to(policy.device)
    level_next = data.sigmas[index + 1].expand(count).to(policy.device)
    x = data.latents[:, column].to(policy.device)
    velocity = guided_velocity(
        policy, data.embeds, data.negative, data.guidance_scale, adapter, detach_uncond
    )
    v = velocity(x, level)
    x_next = data.next_latents[:, column].to(policy.device)
    return transition_log_prob(x, v, x_next, level, level_next, float(data.sigmas[1]), eta)


def forward_copies(data: StepRollout) -> int:
    """How many times [`rescore_step`][mogradient_diffusion.objectives.step_rollout.rescore_step]'s
    forward stacks the rows: 2 under CFG (the unconditional and conditional halves,
    ``guided_velocity``), else 1."""
    return 1 if data.negative is None else 2


def reference_step_mean(policy: Policy, data: StepRollout, column: int, eta: float) -> Tensor:
    """The SDE step's mean under the adapter-free base model (no gradient), for the KL."""
    with torch.no_grad():
        return rescore_step(policy, data, column, eta, False, adapter="reference")[1]


def ratio_metrics(log_probs: Tensor, old_log_probs: Tensor, clip_range: float) -> dict[str, float]:
    """What users of the references ask for: how far the ratio is from 1 and how much clips.

    ``max_abs_ratio_minus_one`` must be ~0 on the first optimizer step after a rollout
    (the policy has not moved yet): a larger value means the training forward does not
    reproduce the sampler's (precision, CFG, a lagged sampling adapter).
    """
    with torch.no_grad():
        log_ratio = (log_probs - old_log_probs).double()
        ratio = log_ratio.exp()
        return {
            "ratio_mean": ratio.mean().item(),
            "ratio_std": ratio.std(unbiased=False).item(),
            "max_abs_ratio_minus_one": (ratio - 1).abs().max().item(),
            "clip_fraction_above": (ratio - 1 > clip_range).double().mean().item(),
            "clip_fraction_below": (1 - ratio > clip_range).double().mean().item(),
            "approx_kl": 0.5 * log_ratio.square().mean().item(),
        }


class RatioTracker:
    """Accumulates the ratio metrics of one optimizer step, the max over the step too.

    ``first_step`` marks the first optimizer step after a rollout, where the policy has
    not moved and every ratio must be 1: its max |r - 1| is the check users ask for.
    """

    def __init__(self, metrics: StepMetrics, clip_range: float, first_step: bool) -> None:
        self.metrics, self.clip_range, self.first_step = metrics, clip_range, first_step
        self.largest = 0.0

    def add(self, log_probs: Tensor, old_log_probs: Tensor) -> None:
        values = ratio_metrics(log_probs, old_log_probs.to(log_probs.device), self.clip_range)
        self.largest = max(self.largest, values.pop("max_abs_ratio_minus_one"))
        for name, value in values.items():
            self.metrics.add(name, value, weight=len(log_probs))

    def close(self) -> None:
        if self.first_step:
            self.metrics.add("first_step_max_abs_ratio_minus_one", self.largest)


def step_rollout(sampled: RolloutBatch, guidance_scale: float) -> StepRollout:
    """The per-step data the step objectives' losses read, from an SDE rollout."""
    trajectories = sampled.trajectories
    return StepRollout(
        prompts=sampled.prompts,
        group_ids=sampled.group_ids,
        images=sampled.images,
        embeds=sampled.embeds,
        negative=sampled.negative,
        latents=trajectories.latents,
        next_latents=trajectories.next_latents,
        log_probs=trajectories.log_probs,
        steps=trajectories.steps,
        sigmas=sampled.sigmas,
        guidance_scale=guidance_scale,
    )


def check_step_objective_config(rollout: RolloutConfig, train: TrainConfig, name: str) -> None:
    """What every objective trained on SDE log-probability ratios needs from the config.

    Sampling uses the ``old`` adapter; the ratio's denominator is that policy, so it must
    be the trained one when the rollout is drawn (``train.old_schedule: copy``), or the
    tiny clip range clips almost every ratio from the first step on.
    """
    if rollout.sampler != "sde":
        raise ConfigError(
            f"objective {name} samples with the flow SDE; set rollout.sampler: sde "
            f"(got {rollout.sampler!r})"
        )
    if train.old_schedule != "copy":
        raise ConfigError(
            f"objective {name} needs the rollout policy to be the trained one: set "
            f"train.old_schedule: copy (got {train.old_schedule!r})"
        )
    if int(rollout.steps * train.timestep_fraction) < 1:
        raise ConfigError(
            f"train.timestep_fraction {train.timestep_fraction} of "
            f"{rollout.steps} rollout.steps trains no step"
        )


__all__ = [
    "RatioTracker",
    "SampledRequest",
    "StepRollout",
    "check_step_objective_config",
    "flow_grpo_steps",
    "forward_copies",
    "ratio_metrics",
    "reference_step_mean",
    "rescore_step",
    "sample_request",
    "step_rollout",
]
