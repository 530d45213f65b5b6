"""Device names from the user (``model.device``, ``eval --device``), checked before any
model loads: a name torch cannot parse, or a GPU this machine lacks, fails in one line."""

from __future__ import annotations

import torch


def parse_device(name: str, key: str) -> torch.device:
    """The device ``name`` names; ValueError naming ``key`` when it is not one or is a GPU
    this machine does not have. A bare ``cuda`` keeps no index (each caller picks one)."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(f"{key} {name!r} is not a device (auto, cpu, cuda, cuda:1, ...)") from None
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ValueError(f"{key} {name!r}: CUDA is not available on this machine; use cpu")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ValueError(
            f"{key} {name!r}: this machine has {count} GPU(s), cuda:0 to cuda:{count - 1}"
        )
    return device
