"""SDPO: step-level reward differences between pairs, as a CombinableLoss per reward.

Two trajectories a, b of one prompt share x_T and draw their own per-step noise. Rewards
are queried on the predicted clean samples at three steps (first, an anchor, last) and
spread to every step by cosine similarity of the x0 predictions; discounted returns are
normalized per (prompt, step) by a persistent tracker. At step t the pair's loss is

    max((u - dA)^2, (u_clip - dA)^2),   u = lambda^t / scale * (rho_a - rho_b),

rho = log p_theta - log p_old (u_clip with rho clipped to +-eps), dA = A_a - A_b with
clamped advantages. Expanding the active square gives shared terms [u^2, u, u_clip^2,
u_clip, 1] and per-reward constants [s, -2 dA s, 1 - s, -2 dA (1 - s), dA^2] / n, where s
marks the active branch (1/2 on ties, as the max's gradient splits): exact for every
reward and every weighted sum of them. The constant term makes the loss values, not only
the gradients, equal the reference's. The shared u grad(u) part makes per-reward
gradients more alike as rho grows, which inflates their cosines.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from mogradient.combinable import CombinableLoss, RowValues, masked_mean_coefficients
from mogradient_diffusion.advantages import group_advantages
from mogradient_diffusion.config.settings import ConfigError
from mogradient_diffusion.model.embeddings import PromptEmbeddings
from mogradient_diffusion.model.policy import Policy
from mogradient_diffusion.objectives.base import (
    Advantages,
    RewardView,
    RolloutRequest,
    Scorer,
    StepMetrics,
    TrainPiece,
    applicable_counts,
    check_real,
)
from mogradient_diffusion.objectives.sdpo_advantages import (
    AnchorSimilarities,
    StepAdvantageTracker,
    anchor_similarities,
    dense_rewards,
    discounted_returns,
)
from mogradient_diffusion.objectives.step_rollout import (
    RatioTracker,
    StepRollout,
    check_step_objective_config,
    forward_copies,
    rescore_step,
    sample_request,
    step_rollout,
)
from mogradient_diffusion.sampling.rollout import paired_noise

if TYPE_CHECKING:
    from mogradient_diffusion.config.settings import RolloutConfig, TrainConfig


@dataclass(frozen=True)
class SDPOSettings:
    """SDPO's objective; defaults are the reference's, except the sampler.

    noise_level: eta of the flow SDE (0.7, Flow-GRPO's; the reference's DDIM eta = 1 is
        another parameterization).
    clip_range: rho is clipped to +-this in u_clip (1e-4).
    gamma: discount of the returns (0.99).
    step_decay: lambda, the weight lambda^t of step t (t = 0 the noisiest) (0.99).
    log_ratio_scale: the paper's eta dividing the log-ratio difference (1).
    advantage_clip: advantages are clamped to +-this before the difference (5).
    buffer_size, min_count: the tracker keeps the last ``buffer_size`` returns per
        (reward, prompt, step) and uses batch statistics below ``min_count`` (32, 16).
    """

    noise_level: float = 0.7
    clip_range: float = 1e-4
    gamma: float = 0.99
    step_decay: float = 0.99
    log_ratio_scale: float = 1.0
    advantage_clip: float = 5.0
    buffer_size: int = 32
    min_count: int = 16

    def __post_init__(self) -> None:
        for name in ("noise_level", "clip_range", "log_ratio_scale", "advantage_clip"):
            check_real(name, getattr(self, name), low=0.0, open_low=True)
        for name in ("gamma", "step_decay"):
            check_real(name, getattr(self, name), low=0.0, high=1.0)
        for name in ("buffer_size", "min_count"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.min_count > self.buffer_size:
            raise ValueError(
                f"min_count {self.min_count} exceeds buffer_size {self.buffer_size}: the "
                "tracker would never use its own statistics"
            )


def pair_log_ratio_difference(
    log_probs_a: Tensor,
    log_probs_b: Tensor,
    old_log_probs_a: Tensor,
    old_log_probs_b: Tensor,
    step_weights: Tensor,
    clip_range: float,
) -> tuple[Tensor, Tensor]:
    """(u, u_clip) [N]: the weighted log-ratio difference, unclipped and with rho in +-eps."""
    rho_a = log_probs_a - old_log_probs_a.detach()
    rho_b = log_probs_b - old_log_probs_b.detach()
    weight = step_weights.detach().to(rho_a.dtype)
    u = weight * (rho_a - rho_b)
    u_clip = weight * (rho_a.clamp(-clip_range, clip_range) - rho_b.clamp(-clip_range, clip_range))
    return u, u_clip


def advantage_differences(advantages_a: Tensor, advantages_b: Tensor, clip: float) -> Tensor:
    """dA = clamp(A_a) - clamp(A_b), elementwise; NaN where either side does not apply."""
    if advantages_a.shape != advantages_b.shape:
        raise ValueError(
            f"advantages_a {tuple(advantages_a.shape)} and advantages_b "
            f"{tuple(advantages_b.shape)} must share a shape"
        )
    if bool(torch.isinf(advantages_a).any() | torch.isinf(advantages_b).any()):
        raise ValueError("advantages contain Inf; mark a reward that does not apply with NaN")
    return advantages_a.clamp(-clip, clip) - advantages_b.clamp(-clip, clip)


def sdpo_loss(
    log_probs_a: Tensor,
    log_probs_b: Tensor,
    old_log_probs_a: Tensor,
    old_log_probs_b: Tensor,
    steps: Tensor,
    differences: Tensor,
    settings: SDPOSettings,
    valid_counts: Tensor | None = None,
    rows: RowValues | None = None,
) -> CombinableLoss:
    """The K per-reward SDPO losses of N (pair, step) entries.

    Log-probs are [N] (the trained ones differentiable), ``steps`` [N] the schedule index
    of each entry, ``differences`` [N, K] the pairs'
    [`advantage_differences`][mogradient_diffusion.objectives.sdpo.advantage_differences] (NaN where
    reward k does not apply). Reward k's loss is the mean over its valid entries (over
    ``valid_counts[k]`` when this is one piece of an optimizer step). ``rows``: where the log-probs
    meet the network, when both sides came from one forward (its row values are both sides'
    log-probs, from which ``log_probs_a`` and ``_b`` are cut).
    """
    n = len(log_probs_a)
    for name, tensor in (
        ("log_probs_b", log_probs_b),
        ("old_log_probs_a", old_log_probs_a),
        ("old_log_probs_b", old_log_probs_b),
        ("steps", steps),
    ):
        if log_probs_a.ndim != 1 or tensor.shape != (n,):
            raise ValueError(f"log_probs_a and {name} must be [N], got {tuple(tensor.shape)}")
    if differences.ndim != 2 or differences.shape[0] != n:
        raise ValueError(f"differences must be [N={n}, K], got {tuple(differences.shape)}")
    if bool(torch.isinf(differences).any()):
        raise ValueError("differences contain Inf; mark a reward that does not apply with NaN")
    dtype = torch.promote_types(log_probs_a.dtype, torch.float32)
    step_weights = settings.step_decay ** steps.to(dtype) / settings.log_ratio_scale
    u, u_clip = pair_log_ratio_difference(
        log_probs_a.to(dtype),
        log_probs_b.to(dtype),
        old_log_probs_a.to(dtype),
        old_log_probs_b.to(dtype),
        step_weights.to(log_probs_a.device),
        settings.clip_range,
    )
    delta = differences.detach().to(device=u.device, dtype=dtype).T  # [K, N]
    unclipped = (u.detach() - delta) ** 2
    clipped = (u_clip.detach() - delta) ** 2
    s = torch.where(unclipped > clipped, 1.0, torch.where(unclipped < clipped, 0.0, 0.5))
    per_sample = torch.stack((s, -2 * delta * s, 1 - s, -2 * delta * (1 - s), delta**2), dim=1).to(
        dtype
    )
    coefficients = masked_mean_coefficients(per_sample, ~torch.isnan(delta), valid_counts)
    terms = torch.stack((u**2, u, u_clip**2, u_clip, torch.ones_like(u)))
    return CombinableLoss(terms=terms, coefficients=coefficients, rows=rows)


@dataclass(frozen=True)
class PairRollout:
    """SDPO's rollout: each sample's trajectory and its pair partner's, row by row.

    Rows 2p and 2p + 1 of a full rollout are a pair (shared x_T). Every row also carries
    a copy of its partner's trajectory (``partner``), so that any subset of rows is a set
    of (row, partner) pairs: the loss of (a, b) equals that of (b, a), so a pair seen
    from both rows counts twice, like every other. ``first_rewards`` and
    ``anchor_rewards`` [B, K] are the rewards of the x0 predictions at the first and the
    anchor step; ``similarities`` [B, 3, T] the cosines to first, anchor and last;
    ``anchors`` [B]; ``prompt_keys`` [B] stable int64 keys of the prompts (the tracker's).
    """

    own: StepRollout
    partner: StepRollout
    first_rewards: Tensor
    anchor_rewards: Tensor
    similarities: Tensor
    anchors: Tensor
    prompt_keys: Tensor

    @property
    def prompts(self) -> list[str]:
        return self.own.prompts

    @property
    def group_ids(self) -> Tensor:
        return self.own.group_ids

    @property
    def images(self) -> Tensor:
        return self.own.images

    def __len__(self) -> int:
        return len(self.own)

    def rows(self, indices: Tensor) -> PairRollout:
        return PairRollout(
            own=self.own.rows(indices),
            partner=self.partner.rows(indices),
            first_rewards=self.first_rewards[indices],
            anchor_rewards=self.anchor_rewards[indices],
            similarities=self.similarities[indices],
            anchors=self.anchors[indices],
            prompt_keys=self.prompt_keys[indices],
        )


def prompt_key(prompt: str) -> int:
    """A stable int64 key of a prompt (the first 8 bytes of its SHA-256), gatherable."""
    return int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big", signed=True)


class SDPOObjective:
    """SDPO (Zhang et al. 2025) for K rewards on the flow SDE: pairs, dense step rewards."""

    name: ClassVar[str] = "sdpo"
    settings_type: ClassVar[type] = SDPOSettings

    def __init__(self, settings: SDPOSettings) -> None:
        self.settings = settings
        self.tracker = StepAdvantageTracker(settings.buffer_size, settings.min_count)
        self._fresh_rollout = False

    @classmethod
    def check_config(
        cls, settings: SDPOSettings, rollout: RolloutConfig, train: TrainConfig
    ) -> None:
        check_step_objective_config(rollout, train, cls.name)
        if rollout.images_per_prompt % 2:
            raise ConfigError(
                "objective sdpo samples pairs: rollout.images_per_prompt must be even, got "
                f"{rollout.images_per_prompt}"
            )
        if rollout.steps < 3:
            raise ConfigError(
                "objective sdpo queries rewards at an interior anchor step: rollout.steps "
                f"must be >= 3, got {rollout.steps}"
            )

    def rollout(self, policy: Policy, request: RolloutRequest, score: Scorer) -> PairRollout:
        """Pairs sharing x_T; SDE on the trained steps (ODE after them, so the last x0
        prediction is the final image); rewards of the first and anchor x0 predictions."""
        settings = request.settings
        pairs = len(request.prompts) * settings.images_per_prompt // 2
        shape = (pairs, *policy.latent_shape(settings.resolution))
        noise = paired_noise(torch.randn(shape, generator=request.generator))
        trained = list(range(int(settings.steps * request.timestep_fraction)))
        eta = self.settings.noise_level
        sampled = sample_request(policy, request, noise, eta, trained, trained, record_x0=True)
        predicted = sampled.trajectories.predicted_x0
        similarities = anchor_similarities(predicted)
        rows = torch.arange(len(predicted))
        queried = torch.cat((predicted[:, 0], predicted[rows, similarities.anchor]))
        images = policy.decode(queried.to(policy.device), batch_size=settings.batch_size)
        rewards = score(images, sampled.prompts * 2, sampled.metadata * 2).detach().cpu()
        first, anchor = rewards.double().chunk(2)
        own = step_rollout(sampled, settings.guidance_scale)
        self._fresh_rollout = True
        return PairRollout(
            own=own,
            partner=own.rows(rows ^ 1),
            first_rewards=first,
            anchor_rewards=anchor,
            # Beside the rewards on the host, where the advantages are computed.
            similarities=torch.stack(
                (similarities.first, similarities.middle, similarities.last), dim=1
            ).cpu(),
            anchors=similarities.anchor.cpu(),
            prompt_keys=torch.tensor([prompt_key(p) for p in sampled.prompts]),
        )

    def advantages(
        self, batch: PairRollout, view: RewardView, *, probe: bool = False
    ) -> Advantages:
        """Dense rewards, discounted returns, tracker-normalized per (prompt, step), and the
        pair's clamped difference dA at each trained step: [B, S, K'].

        The tracker sees every rank's returns, so every rank keeps the same state; a probe
        call works on a copy.
        """
        similarities = AnchorSimilarities(
            anchor=batch.anchors,
            first=batch.similarities[:, 0],
            middle=batch.similarities[:, 1],
            last=batch.similarities[:, 2],
        )
        final = view.rewards[view.rows].double()
        dense = dense_rewards(batch.first_rewards, batch.anchor_rewards, final, similarities)
        count, steps, rewards = dense.shape
        dense = view.to_objectives(dense.reshape(count * steps, rewards)).reshape(count, steps, -1)
        returns = view.gather(discounted_returns(dense.double(), self.settings.gamma))
        keys = [str(key) for key in view.gather(batch.prompt_keys).tolist()]
        tracker = copy.deepcopy(self.tracker) if probe else self.tracker
        normalized = tracker.update(keys, returns)
        local = normalized[view.rows]
        partner = torch.arange(count) ^ 1
        differences = advantage_differences(local, local[partner], self.settings.advantage_clip)
        values = differences[:, batch.own.steps]
        every = view.gather(values)
        _, final_stats = group_advantages(view.to_objectives(view.rewards), view.group_ids)
        stats = {
            # prompt groups whose final images all scored alike (per objective)
            "zero_std_group_ratio": final_stats["zero_std_group_ratio"].double(),
            "return_mean": _nan_mean(returns.flatten(0, 1)),
            "advantage_abs_mean": _nan_mean(normalized.abs().flatten(0, 1)),
            "difference_abs_mean": _nan_mean(every.abs().flatten(0, 1)),
        }
        return Advantages(values.float(), {k: v.float() for k, v in stats.items()})

    def losses(
        self,
        policy: Policy,
        step: Sequence[TrainPiece],
        generator: torch.Generator,
        metrics: StepMetrics,
    ) -> Iterator[tuple[float, CombinableLoss]]:
        """One piece per micro-batch x trained step: both trajectories of each row's pair
        rescored in one forward; every valid (pair, step) entry weighs the same."""
        ratios = RatioTracker(metrics, self.settings.clip_range, self._fresh_rollout)
        self._fresh_rollout = False
        valid_counts = applicable_counts(step)
        eta = self.settings.noise_level
        for piece in step:
            data: PairRollout = piece.data
            both = _stack_pairs(data.own, data.partner)
            for column in range(len(data.own.steps)):
                log_probs, _, _ = rescore_step(policy, both, column, eta, detach_uncond=False)
                old = both.log_probs[:, column].to(log_probs.device)
                ratios.add(log_probs.detach(), old)
                own, partner = log_probs.chunk(2)
                old_own, old_partner = old.chunk(2)
                steps = data.own.steps[column].expand(len(data)).to(log_probs.device)
                loss = sdpo_loss(
                    own,
                    partner,
                    old_own,
                    old_partner,
                    steps,
                    piece.advantages[:, column],
                    self.settings,
                    valid_counts,
                    rows=RowValues(log_probs, copies=forward_copies(both)),
                )
                yield 1.0, loss
        ratios.close()

    def state_dict(self) -> dict[str, Any]:
        """The advantage tracker's buffers: advantages after a resume depend on them."""
        return {"tracker": self.tracker.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "tracker" not in state:
            raise ValueError(
                "an sdpo checkpoint holds the advantage tracker under 'tracker'; got keys "
                f"{sorted(state)} (a checkpoint of another objective?)"
            )
        self.tracker.load_state_dict(state["tracker"])


def _stack_pairs(own: StepRollout, partner: StepRollout) -> StepRollout:
    """Both sides of each row's pair as one batch (own rows first), for one forward."""
    negative = None
    if own.negative is not None:
        negative = PromptEmbeddings.cat([own.negative, partner.negative])
    return dataclasses.replace(
        own,
        prompts=own.prompts + partner.prompts,
        group_ids=torch.cat([own.group_ids, partner.group_ids]),
        images=torch.cat([own.images, partner.images]),
        embeds=PromptEmbeddings.cat([own.embeds, partner.embeds]),
        negative=negative,
        latents=torch.cat([own.latents, partner.latents]),
        next_latents=torch.cat([own.next_latents, partner.next_latents]),
        log_probs=torch.cat([own.log_probs, partner.log_probs]),
    )


def _nan_mean(values: Tensor) -> Tensor:
    """Per column mean over the non-NaN rows (NaN for a column without any)."""
    present = ~torch.isnan(values)
    return torch.where(present, values, 0).sum(0) / present.sum(0)


__all__ = [
    "PairRollout",
    "SDPOObjective",
    "SDPOSettings",
    "advantage_differences",
    "pair_log_ratio_difference",
    "prompt_key",
    "sdpo_loss",
]
