"""Harmonizers: per-objective gradients (or their Gram) -> weights on the raw gradients."""

from __future__ import annotations

from typing import Any

from mogradient._gram import CosineGram
from mogradient.harmonizers.aligned_mtl import AlignedMTL
from mogradient.harmonizers.base import Harmonization, Harmonizer, WeighResult, combine
from mogradient.harmonizers.cagrad import CAGrad
from mogradient.harmonizers.dropout import RewardDropout
from mogradient.harmonizers.dualproj import DualProj
from mogradient.harmonizers.gradvac import GradVac
from mogradient.harmonizers.imtlg import IMTLG
from mogradient.harmonizers.mgda import MGDA
from mogradient.harmonizers.nash_mtl import NashMTL
from mogradient.harmonizers.pcgrad import PCGrad
from mogradient.harmonizers.upgrad import UPGrad
from mogradient.harmonizers.weighted import FixedWeights, Mean, RandomWeights

HARMONIZERS: dict[str, type[Harmonizer]] = {
    "mgda": MGDA,
    "pcgrad": PCGrad,
    "fixed": FixedWeights,
    "mean": Mean,
    "rlw": RandomWeights,
    "cagrad": CAGrad,
    "nashmtl": NashMTL,
    "upgrad": UPGrad,
    "dualproj": DualProj,
    "imtlg": IMTLG,
    "alignedmtl": AlignedMTL,
    "gradvac": GradVac,
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
    "IMTLG",
    "MGDA",
    "AlignedMTL",
    "CAGrad",
    "CosineGram",
    "DualProj",
    "FixedWeights",
    "GradVac",
    "Harmonization",
    "Harmonizer",
    "Mean",
    "NashMTL",
    "PCGrad",
    "RandomWeights",
    "RewardDropout",
    "UPGrad",
    "WeighResult",
    "combine",
    "make_harmonizer",
]
