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


@register_reward
class Vandal(Reward):
    """Zeroes the images it is given and the metadata it reads: it must harm no other reward."""

    name = "vandal"
    value_range = (-math.inf, math.inf)

    def score(self, images, prompts, metadata):
        images.zero_()
        for entry in metadata or []:
            entry.clear()
        return torch.zeros(len(prompts))


@register_reward
class Quitting(Reward):
    """Calls ``sys.exit(0)`` while scoring, as a reward script written for the command line."""

    name = "quitting"
    value_range = (-math.inf, math.inf)

    def score(self, images, prompts, metadata):
        raise SystemExit(0)
