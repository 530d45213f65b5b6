"""The epoch's sample grid: the first image of each of the rollout's first prompts, small
enough to log every epoch (a few hundred KB at most, whatever the resolution)."""

from __future__ import annotations

import numpy as np
import torch

COUNT = 8  # prompts shown
COLUMNS = 4
TILE = 256  # largest tile side in pixels; smaller images keep their size


def sample_grid(images: torch.Tensor, per_prompt: int) -> np.ndarray:
    """An H x W x 3 uint8 grid of ``images`` ([B, 3, H, W] in [0, 1], a prompt's
    ``per_prompt`` images adjacent), one tile per prompt."""
    chosen = images[::per_prompt][:COUNT].detach().float().clamp(0, 1)
    side = max(chosen.shape[-2:])
    if side > TILE:
        size = (chosen.shape[-2] * TILE // side, chosen.shape[-1] * TILE // side)
        chosen = torch.nn.functional.interpolate(chosen, size=size, mode="area")
    count, channels, height, width = chosen.shape
    rows = -(-count // COLUMNS)
    columns = min(count, COLUMNS)
    grid = chosen.new_ones(channels, rows * height, columns * width)
    for index, image in enumerate(chosen):
        row, column = divmod(index, COLUMNS)
        grid[:, row * height : (row + 1) * height, column * width : (column + 1) * width] = image
    return (grid.permute(1, 2, 0) * 255).round().to(torch.uint8).cpu().numpy()
