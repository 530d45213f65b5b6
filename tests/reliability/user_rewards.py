"""User rewards for the reliability tests, registered through ``reward_modules``."""

from __future__ import annotations

import math

import torch

from mogradient_diffusion.rewards import Reward, register_reward


@register_reward
class NeverApplies(Reward):
    """NaN for every image: a reward that gives no training signal."""

    name = "never_applies"
    value_range = (-math.inf, math.inf)

    def score(self, images, prompts, metadata):
        return torch.full((len(prompts),), float("nan"))


@register_reward
class Raising(Reward):
    """Fails while scoring, as a reward whose server or model breaks mid-run."""

    name = "raising"
    value_range = (-math.inf, math.inf)

    def score(self, images, prompts, metadata):
        raise ConnectionError("scoring server unreachable")
