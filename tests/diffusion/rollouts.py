"""One rollout of a trainer's first epoch prompts, for tests that train on it by hand."""

from __future__ import annotations

from typing import Any

import torch

from mogradient_diffusion.objectives import RolloutRequest
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
