"""Rollouts for tests: a trainer's first-epoch rollout to train on by hand, and a recorded
SDE step rescored as Flow-GRPO's training forward scores it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mogradient_diffusion.objectives import RolloutRequest
from mogradient_diffusion.sampling.sde import transition_log_prob
from mogradient_diffusion.training.trainer import Trainer


def first_rollout(trainer: Trainer, seed: int = 0) -> Any:
    """The objective's rollout of this rank's first prompts, sampled with ``seed``."""
    drawn = trainer._epoch_prompts()
    config = trainer.config
    request = RolloutRequest(
        prompts=[item.prompt for item in drawn],
        metadata=[item.metadata for item in drawn],
        settings=config.rollout,
        timestep_fraction=config.train.timestep_fraction,
        generator=torch.Generator().manual_seed(seed),
    )
    return trainer.objective.rollout(trainer.policy, request, trainer._score)


def rescored_log_prob(
    result: Any, velocity: Callable, sigmas: torch.Tensor, step: int, eta: float
) -> torch.Tensor:
    """log p of recorded SDE step ``step`` of ``result`` (an ``integrate`` result) under
    ``velocity``, with grad on, as Flow-GRPO's training forward scores it for its ratio."""
    i = int(result.steps[step])
    level = sigmas[i].expand(len(result.latents))
    v = velocity(result.latents[:, step], level)
    assert v.requires_grad
    log_prob, _, _ = transition_log_prob(
        result.latents[:, step],
        v,
        result.next_latents[:, step],
        level,
        sigmas[i + 1],
        float(sigmas[1]),
        eta,
    )
    return log_prob
