"""Harmonizers: per-objective gradients (or their Gram) -> weights on the raw gradients."""

from __future__ import annotations

from typing import Any

from mogradient.harmonizers.base import Harmonization, Harmonizer, Weighting, combine
from mogradient.harmonizers.dropout import RewardDropout
from mogradient.harmonizers.mgda import MGDA
from mogradient.harmonizers.pcgrad import PCGrad
from mogradient.harmonizers.weighted import FixedWeights, Mean, RandomWeights

HARMONIZERS: dict[str, type[Harmonizer]] = {
    "mgda": MGDA,
    "pcgrad": PCGrad,
    "fixed": FixedWeights,
    "mean": Mean,
    "rlw": RandomWeights,
}


def make_harmonizer(name: str, **options: Any) -> Harmonizer:
    """Build a harmonizer by registry name (``mgda``, ``pcgrad``, ``upgrad``, ...)."""
    try:
        cls = HARMONIZERS[name.lower()]
    except KeyError:
        known = ", ".join(sorted(HARMONIZERS))
        raise ValueError(f"unknown harmonizer {name!r}; choose one of: {known}") from None
    return cls(**options)


__all__ = [
    "HARMONIZERS",
    "MGDA",
    "FixedWeights",
    "Harmonization",
    "Harmonizer",
    "Mean",
    "PCGrad",
    "RandomWeights",
    "RewardDropout",
    "Weighting",
    "combine",
    "make_harmonizer",
]
