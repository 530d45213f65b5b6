"""The largest image a pipeline takes, read from its config files before any weight loads.

SD3's transformer adds a learned position embedding cropped to the image's grid of
patches; a grid wider than ``pos_embed_max_size`` fails in the first forward pass, deep in
diffusers and after the model has loaded. FLUX and Qwen-Image use rotary positions and
have no such bound.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def max_resolution(model_path: str | None) -> int | None:
    """The largest square image, in pixels, the pipeline's transformer can take; None when
    it has no bound or it cannot be told (a hub id, missing or unreadable config files)."""
    if model_path is None:
        return _tiny_max_resolution()
    root = Path(model_path)
    transformer = _json(root / "transformer" / "config.json")
    vae = _json(root / "vae" / "config.json")
    try:
        positions = int(transformer["pos_embed_max_size"])
        patch = int(transformer["patch_size"])
        vae_blocks = len(vae["block_out_channels"])
    except (KeyError, TypeError, ValueError):
        return None
    return _pixels(positions, patch, vae_blocks)


def _tiny_max_resolution() -> int:
    """The tiny pipeline's bound (model.path unset), from the sizes model/tiny.py builds."""
    from mogradient_diffusion.model.tiny import TinySD3Spec

    spec = TinySD3Spec()
    return _pixels(spec.positions, spec.patch_size, spec.vae_blocks)


def _pixels(positions: int, patch: int, vae_blocks: int) -> int:
    """Image side of a grid of ``positions`` patches: a patch is ``patch`` latent pixels, a
    latent pixel 2^(vae_blocks - 1) image pixels."""
    return positions * patch * 2 ** (vae_blocks - 1)


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
