"""Model-free rewards that are smooth in the pixels, registered through ``reward_modules``:
round-off in the images stays round-off in the scores (JPEG sizes and color thresholds
can flip), so two runs that differ by round-off can be compared step by step."""

from __future__ import annotations

import math

from mogradient_diffusion.rewards import Reward, register_reward


@register_reward
class Brightness(Reward):
    """Mean pixel value."""

    name = "smooth_brightness"
    value_range = (0.0, 1.0)

    def score(self, images, prompts, metadata):
        return images.mean(dim=(1, 2, 3))


@register_reward
class Redness(Reward):
    """Mean red minus mean green and blue: pulls against brightness on green and blue."""

    name = "smooth_redness"
    value_range = (-math.inf, math.inf)

    def score(self, images, prompts, metadata):
        red, green, blue = images.mean(dim=(2, 3)).unbind(dim=1)
        return red - (green + blue) / 2
