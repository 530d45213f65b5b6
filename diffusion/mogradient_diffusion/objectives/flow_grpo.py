"""Flow-GRPO's clipped-ratio loss as a CombinableLoss, one objective per reward.

Per (image, trained step) entry with ratio r = exp(log p_theta - log p_old) and reward k's
advantage A, the reference loss is max(-A r, -A clip(r, 1 - eps, 1 + eps)). For A >= 0
that is -A min(r, 1 + eps), for A < 0 it is |A| max(r, 1 - eps): so the shared terms
P = min(r, 1 + eps) and N = max(r, 1 - eps) with the constant coefficients
-max(A, 0) / n and max(-A, 0) / n give every reward's loss exactly, and any weighted sum
of them in one backward pass. The KL to the reference model, beta mean((mu_theta -
mu_ref)^2 / (2 sigma_t^2)), is not harmonized: it goes in ``extra``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from mogradient.combinable import CombinableLoss, RowValues, masked_mean_coefficients
from mogradient_diffusion.advantages import group_advantages
from mogradient_diffusion.config.settings import ConfigError
from mogradient_diffusion.model.policy import Policy
from mogradient_diffusion.objectives.base import (
    Advantages,
    RewardView,
    RolloutRequest,
    Scorer,
    Stateless,
    StepMetrics,
    TrainPiece,
    applicable_counts,
    check_real,
)
from mogradient_diffusion.objectives.step_rollout import (
    RatioTracker,
    StepRollout,
    check_step_objective_config,
    flow_grpo_steps,
    forward_copies,
    reference_step_mean,
    rescore_step,
    sample_request,
    step_rollout,
)

if TYPE_CHECKING:
    from mogradient_diffusion.config.settings import RolloutConfig, TrainConfig


@dataclass(frozen=True)
class FlowGRPOSettings:
    """Flow-GRPO's objective; defaults are the reference's SD3.5-M ones.

    clip_range: eps of the ratio clip (1e-4).
    kl_coefficient: beta of the KL to the reference model (0.04 for OCR and GenEval,
        0.01 for PickScore); 0 skips the reference forward.
    noise_level: the SDE's eta (0.7).
    advantage_clip: advantages are clamped to +-this (5).
    std_eps: added to the batch std before dividing (1e-4).
    window_size, window_range: Flow-GRPO-Fast; SDE (and training) only on a window of
        ``window_size`` steps starting uniformly in [lo, hi - w]. None: every step is SDE.
    detach_uncond: stop gradients through CFG's unconditional branch (July 2025 code).
    """

    clip_range: float = 1e-4
    kl_coefficient: float = 0.04
    noise_level: float = 0.7
    advantage_clip: float = 5.0
    std_eps: float = 1e-4
    window_size: int | None = None
    window_range: tuple[int, int] = (0, 5)
    detach_uncond: bool = True

    def __post_init__(self) -> None:
        check_real("clip_range", self.clip_range, low=0, open_low=True)
        check_real("kl_coefficient", self.kl_coefficient, low=0)
        check_real("noise_level", self.noise_level, low=0, open_low=True)
        check_real("advantage_clip", self.advantage_clip, low=0, open_low=True)
        check_real("std_eps", self.std_eps, low=0, open_low=True)
        if self.window_size is not None and (
            not isinstance(self.window_size, int) or self.window_size < 1
        ):
            raise ValueError(
                f"window_size must be a positive integer or None, got {self.window_size!r}"
            )
        low, high = self.window_range
        if not (isinstance(low, int) and isinstance(high, int) and 0 <= low < high):
            raise ValueError(
                f"window_range must be integers 0 <= lo < hi, got {self.window_range!r}"
            )
        if self.window_size is not None and self.window_size > high - low:
            raise ValueError(
                f"window_size {self.window_size} does not fit in window_range {self.window_range}"
            )
        object.__setattr__(self, "window_range", (low, high))


def flow_grpo_advantages(
    rewards: Tensor, group_ids: Tensor, settings: FlowGRPOSettings
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-reward advantages [B, K]: (r - group mean) / (batch std + std_eps), clamped.

    NaN rewards (not applicable) stay NaN. Also returns the per-reward statistics of
    [`group_advantages`][mogradient_diffusion.advantages.group_advantages] (``zero_std_group_ratio``
    among them).
    """
    return group_advantages(
        rewards, group_ids, std="global", clip=settings.advantage_clip, eps=settings.std_eps
    )


def clipped_ratio_terms(log_probs: Tensor, old_log_probs: Tensor, clip_range: float) -> Tensor:
    """The shared terms [2, N]: P = min(r, 1 + eps) and N = max(r, 1 - eps)."""
    ratio = torch.exp(log_probs - old_log_probs.detach())
    return torch.stack((ratio.clamp(max=1 + clip_range), ratio.clamp(min=1 - clip_range)))


def flow_grpo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    settings: FlowGRPOSettings,
    kl: Tensor | None = None,
    valid_counts: Tensor | None = None,
    total_entries: int | None = None,
    row_copies: int | None = None,
) -> CombinableLoss:
    """The K per-reward Flow-GRPO losses of N (image, step) entries.

    ``log_probs`` [N] is differentiable, ``old_log_probs`` [N] the rollout's, ``advantages``
    [N, K] (NaN where reward k does not apply; clamped here). Reward k's loss is the mean
    over its valid entries, over ``valid_counts[k]`` of them when these N entries are one
    piece of an optimizer step. ``kl`` [N] is each entry's mean((mu - mu_ref)^2) /
    (2 sigma_t^2); beta times its mean over ``total_entries`` (default N) is ``extra``.
    ``row_copies``: the N entries are the rows of one forward, stacked that many times
    (2 under CFG): every term then reaches the network through its row's log-probability,
    and the loss declares it ([`RowValues`][mogradient.combinable.RowValues]).
    """
    if log_probs.ndim != 1 or old_log_probs.shape != log_probs.shape:
        raise ValueError(
            f"log_probs and old_log_probs must be [N], got {tuple(log_probs.shape)} and "
            f"{tuple(old_log_probs.shape)}"
        )
    if advantages.ndim != 2 or advantages.shape[0] != len(log_probs):
        raise ValueError(
            f"advantages must be [N={len(log_probs)}, K], got {tuple(advantages.shape)}"
        )
    if bool(torch.isinf(advantages).any()):
        raise ValueError("advantages contain Inf; mark a reward that does not apply with NaN")
    dtype = torch.promote_types(log_probs.dtype, torch.float32)
    terms = clipped_ratio_terms(log_probs.to(dtype), old_log_probs.to(dtype), settings.clip_range)
    clip = settings.advantage_clip
    a = advantages.detach().to(device=terms.device, dtype=dtype).clamp(-clip, clip).T
    per_sample = torch.stack((-a.clamp(min=0), (-a).clamp(min=0)), dim=1)
    coefficients = masked_mean_coefficients(per_sample, ~torch.isnan(a), valid_counts)
    extra = None
    if kl is not None:
        if kl.shape != log_probs.shape:
            raise ValueError(f"kl must be [N={len(log_probs)}], got {tuple(kl.shape)}")
        extra = settings.kl_coefficient * kl.to(dtype).sum() / (total_entries or len(kl))
    rows = None if row_copies is None else RowValues(log_probs, copies=row_copies)
    return CombinableLoss(terms=terms, coefficients=coefficients, extra=extra, rows=rows)


def kl_to_reference(mean: Tensor, reference_mean: Tensor, noise_scale: Tensor) -> Tensor:
    """Per entry mean((mu_theta - mu_ref)^2) / (2 sigma_t^2), sigma_t the SDE noise scale.

    As the reference: no sqrt(-dt) in the denominator (flow_grpo issue #78).
    """
    if mean.shape != reference_mean.shape:
        raise ValueError(
            f"mean {tuple(mean.shape)} and reference_mean {tuple(reference_mean.shape)} differ"
        )
    squared = (mean - reference_mean.detach()).square().flatten(1).mean(dim=1)
    return squared / (2 * noise_scale.detach().reshape(-1).to(squared.dtype) ** 2)


class FlowGRPOObjective(Stateless):
    """Flow-GRPO (Liu et al. 2025) for K rewards: SDE rollouts, clipped ratios, KL in extra."""

    name: ClassVar[str] = "flow_grpo"
    settings_type: ClassVar[type] = FlowGRPOSettings

    def __init__(self, settings: FlowGRPOSettings) -> None:
        self.settings = settings
        self._fresh_rollout = False

    @classmethod
    def check_config(
        cls, settings: FlowGRPOSettings, rollout: RolloutConfig, train: TrainConfig
    ) -> None:
        check_step_objective_config(rollout, train, cls.name)
        steps = rollout.steps
        if settings.window_size is not None and settings.window_range[1] > steps:
            raise ConfigError(
                f"objective.window_range {list(settings.window_range)} reaches past the "
                f"{steps} sampling steps (rollout.steps)"
            )

    def rollout(self, policy: Policy, request: RolloutRequest, score: Scorer) -> StepRollout:
        """SDE on every step (or a random window); x_t, x_next, log p_old of the trained steps."""
        settings = request.settings
        shape = (len(request.prompts) * settings.images_per_prompt,)
        noise = torch.randn(
            shape + policy.latent_shape(settings.resolution), generator=request.generator
        )
        sde_steps, trained = flow_grpo_steps(
            settings.steps,
            request.timestep_fraction,
            self.settings.window_size,
            self.settings.window_range,
            request.generator,
        )
        sampled = sample_request(
            policy, request, noise, self.settings.noise_level, sde_steps, trained
        )
        self._fresh_rollout = True
        return step_rollout(sampled, settings.guidance_scale)

    def advantages(
        self, batch: StepRollout, view: RewardView, *, probe: bool = False
    ) -> Advantages:
        """Per-prompt-group advantages over the batch std, clamped; the same at every step."""
        values, stats = flow_grpo_advantages(
            view.to_objectives(view.rewards), view.group_ids, self.settings
        )
        return Advantages(values[view.rows], stats)

    def losses(
        self,
        policy: Policy,
        step: Sequence[TrainPiece],
        generator: torch.Generator,
        metrics: StepMetrics,
    ) -> Iterator[tuple[float, CombinableLoss]]:
        """One piece per micro-batch x recorded step; every (sample, step) entry weighs the same."""
        ratios = RatioTracker(metrics, self.settings.clip_range, self._fresh_rollout)
        self._fresh_rollout = False
        columns = len(step[0].data.steps)
        valid_counts = applicable_counts(step) * columns
        entries = sum(len(p) for p in step) * columns
        eta = self.settings.noise_level
        for piece in step:
            data = piece.data
            for column in range(columns):
                log_probs, mean, scale = rescore_step(
                    policy, data, column, eta, self.settings.detach_uncond
                )
                old = data.log_probs[:, column].to(log_probs.device)
                ratios.add(log_probs.detach(), old)
                kl = None
                if self.settings.kl_coefficient > 0:
                    reference = reference_step_mean(policy, data, column, eta)
                    kl = kl_to_reference(mean, reference, scale)
                    metrics.add("kl_to_reference", kl.detach().mean(), weight=len(data))
                yield (
                    1.0,
                    flow_grpo_loss(
                        log_probs,
                        old,
                        piece.advantages,
                        self.settings,
                        kl,
                        valid_counts,
                        entries,
                        row_copies=forward_copies(data),
                    ),
                )
        ratios.close()


__all__ = [
    "FlowGRPOObjective",
    "FlowGRPOSettings",
    "clipped_ratio_terms",
    "flow_grpo_advantages",
    "flow_grpo_loss",
    "kl_to_reference",
]
