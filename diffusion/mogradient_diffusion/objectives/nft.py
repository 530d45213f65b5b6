"""DiffusionNFT as an objective: deterministic rollouts, group advantages, branch losses.

NFT trains on the final clean latents only, so any deterministic sampler serves. Each
optimizer step draws, per sample, ``int(timestep_fraction x steps)`` distinct noise levels
of the sampling schedule and fresh noise, and averages the per-level NFT losses
(``nft_loss``): each reward's loss is a mean over the step's applicable
samples, so the step's gradient does not depend on how it is cut into micro-batches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from mogradient.combinable import CombinableLoss
from mogradient_diffusion.advantages import group_advantages
from mogradient_diffusion.model.embeddings import PromptEmbeddings
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
)
from mogradient_diffusion.objectives.nft_loss import NFTSettings, nft_loss
from mogradient_diffusion.sampling.rollout import rollout


@dataclass(frozen=True)
class GroupDraws:
    """Noise levels and noise per prompt group, for ``shared_noise`` (common random numbers)."""

    levels: dict[int, torch.Tensor]  # group -> [columns] distinct level indices
    noise: dict[int, torch.Tensor]  # group -> [columns, *latent shape]

    @classmethod
    def draw(
        cls, step: Sequence[TrainPiece], levels: int, columns: int, generator: torch.Generator
    ) -> GroupDraws:
        groups = torch.unique(torch.cat([piece.data.group_ids for piece in step])).tolist()
        shape = step[0].data.latents.shape[1:]
        return cls(
            {g: torch.randperm(levels, generator=generator)[:columns] for g in groups},
            {g: torch.randn(columns, *shape, generator=generator) for g in groups},
        )

    def levels_for(self, piece: TrainPiece) -> torch.Tensor:
        return torch.stack([self.levels[g] for g in piece.data.group_ids.tolist()])

    def noise_for(self, piece: TrainPiece, column: int) -> torch.Tensor:
        return torch.stack([self.noise[g][column] for g in piece.data.group_ids.tolist()])


@dataclass(frozen=True)
class NFTRollout:
    """Final samples of one rank's rollout and what NFT trains on them with.

    ``sigmas`` is the sampling schedule (steps + 1 levels, the final 0 included), shared
    by every row; ``timesteps`` how many of its levels each sample trains on per step.
    """

    prompts: list[str]
    group_ids: torch.Tensor
    images: torch.Tensor
    latents: torch.Tensor
    embeds: PromptEmbeddings
    sigmas: torch.Tensor
    timesteps: int

    def __len__(self) -> int:
        return len(self.prompts)

    def rows(self, indices: torch.Tensor) -> NFTRollout:
        return dataclasses.replace(
            self,
            prompts=[self.prompts[i] for i in indices.tolist()],
            group_ids=self.group_ids[indices],
            images=self.images[indices.to(self.images.device)],
            latents=self.latents[indices.to(self.latents.device)],
            embeds=self.embeds.index(indices),
        )


class NFTObjective(Stateless):
    """DiffusionNFT (Zheng et al. 2025) for K rewards, as one CombinableLoss per piece."""

    name: ClassVar[str] = "nft"
    settings_type: ClassVar[type] = NFTSettings

    def __init__(self, settings: NFTSettings) -> None:
        self.settings = settings

    def rollout(self, policy: Policy, request: RolloutRequest, score: Scorer) -> NFTRollout:
        """Sample with the configured solver; only final latents are kept."""
        settings = request.settings
        batch = rollout(
            policy,
            request.prompts,
            images_per_prompt=settings.images_per_prompt,
            steps=settings.steps,
            guidance_scale=settings.guidance_scale,
            sampler=settings.sampler,
            resolution=settings.resolution,
            generator=request.generator,
            adapter="old",
            batch_size=settings.batch_size,
            max_sequence_length=settings.max_sequence_length,
            progress=request.progress,
            on_images=request.on_images,
        )
        # int(), as the reference trainers: 0.99 x 10 steps trains 9 timesteps.
        timesteps = max(1, int(request.timestep_fraction * settings.steps))
        return NFTRollout(
            prompts=batch.prompts,
            group_ids=batch.group_ids,
            images=batch.images,
            latents=batch.latents,
            embeds=batch.embeds,
            sigmas=batch.sigmas,
            timesteps=timesteps,
        )

    def advantages(self, batch: NFTRollout, view: RewardView, *, probe: bool = False) -> Advantages:
        """Per-prompt-group advantages, normalized by the batch (or group) std, clipped."""
        values, stats = group_advantages(
            view.to_objectives(view.rewards),
            view.group_ids,
            std=self.settings.advantage_std,
            clip=self.settings.a_max if view.clip else None,
        )
        return Advantages(values[view.rows], stats)

    def losses(
        self,
        policy: Policy,
        step: Sequence[TrainPiece],
        generator: torch.Generator,
        metrics: StepMetrics,
    ) -> Iterator[tuple[float, CombinableLoss]]:
        """One piece per micro-batch x trained noise level; levels are averaged.

        The noise levels of every row are drawn first (distinct levels per row), then
        one noise tensor per piece and level; with ``shared_noise`` each prompt group's
        levels and noise are drawn first and copied to its rows. The KL term is the
        step's mean: each piece's share of it is its share of the step's rows.
        """
        first = step[0].data
        sigmas = first.sigmas[:-1]  # the final 0 is not a training level
        columns = first.timesteps
        shared = (
            GroupDraws.draw(step, len(sigmas), columns, generator)
            if self.settings.shared_noise
            else None
        )
        if shared is None:
            orders = [
                torch.stack(
                    [
                        torch.randperm(len(sigmas), generator=generator)[:columns]
                        for _ in range(len(p))
                    ]
                )
                for p in step
            ]
        else:
            orders = [shared.levels_for(piece) for piece in step]
        valid_counts = applicable_counts(step)
        total_rows = sum(len(piece) for piece in step)
        for piece, order in zip(step, orders, strict=True):
            latents = piece.data.latents
            share = len(piece) / total_rows
            for column in range(columns):
                sigma = sigmas[order[:, column]].to(latents)
                if shared is None:
                    noise = torch.randn(latents.shape, generator=generator).to(latents)
                else:
                    noise = shared.noise_for(piece, column).to(latents)
                shaped = sigma.view(-1, *([1] * (latents.ndim - 1)))
                noisy = (1 - shaped) * latents + shaped * noise
                loss = self._loss(policy, piece, noisy, sigma, valid_counts, metrics)
                if loss.extra is not None:
                    loss = dataclasses.replace(loss, extra=loss.extra * share)
                yield 1.0 / columns, loss

    def _loss(
        self,
        policy: Policy,
        piece: TrainPiece,
        noisy: torch.Tensor,
        sigma: torch.Tensor,
        valid_counts: torch.Tensor,
        metrics: StepMetrics,
    ) -> CombinableLoss:
        embeds = piece.data.embeds
        v_old = policy.velocity(noisy, sigma, embeds, adapter="old")
        v_reference = None
        if self.settings.kl_coefficient > 0:
            v_reference = policy.velocity(noisy, sigma, embeds, adapter="reference")
        v_theta = policy.velocity(noisy, sigma, embeds, adapter="default")
        # ||v_theta - v_old||^2: exactly 0 while the old adapter equals the trained one,
        # where NFT's two branches coincide and the loss is a weighted regression.
        gap = (v_theta.detach().float() - v_old.float()).square().mean()
        metrics.add("velocity_gap_to_old", gap, weight=len(piece))
        return nft_loss(
            v_theta,
            v_old,
            noisy,
            piece.data.latents,
            sigma,
            piece.advantages,
            self.settings,
            v_reference=v_reference,
            valid_counts=valid_counts,
        )
