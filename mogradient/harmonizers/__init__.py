"""Harmonizers: per-objective gradients (or their Gram) -> weights on the raw gradients."""

from __future__ import annotations

from typing import Any

from mogradient._gram import CosineGram
from mogradient.harmonizers.aligned_mtl import AlignedMTL
from mogradient.harmonizers.base import Harmonization, Harmonizer, WeighResult, combine
from mogradient.harmonizers.cagrad import CAGrad
from mogradient.harmonizers.config_grad import ConFIG
from mogradient.harmonizers.cr_mogm import CRMOGM
from mogradient.harmonizers.dropout import RewardDropout
from mogradient.harmonizers.dualproj import DualProj
from mogradient.harmonizers.excess_mtl import ExcessMTL
from mogradient.harmonizers.fairgrad import FairGrad
from mogradient.harmonizers.graddrop import GradDrop
from mogradient.harmonizers.gradvac import GradVac
from mogradient.harmonizers.imtlg import IMTLG
from mogradient.harmonizers.krum import Krum
from mogradient.harmonizers.mgda import MGDA
from mogradient.harmonizers.modo import MoDo
from mogradient.harmonizers.nash_mtl import NashMTL
from mogradient.harmonizers.pcd import PCD
from mogradient.harmonizers.pcgrad import PCGrad
from mogradient.harmonizers.sdmgrad import SDMGrad
from mogradient.harmonizers.trimmed_mean import TrimmedMean
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
    "config": ConFIG,
    "fairgrad": FairGrad,
    "krum": Krum,
    "trimmedmean": TrimmedMean,
    "graddrop": GradDrop,
    "excessmtl": ExcessMTL,
    "crmogm": CRMOGM,
    "modo": MoDo,
    "sdmgrad": SDMGrad,
    "pcd": PCD,
}


def make_harmonizer(name: str, **options: Any) -> Harmonizer:
    """Build a harmonizer by registry name (``mgda``, ``pcgrad``, ``upgrad``, ...).

    A wrapper's ``inner`` harmonizer (CR-MOGM's) may be given by its registry name too.
    """
    if isinstance(options.get("inner"), str):
        options = {**options, "inner": make_harmonizer(options["inner"])}
    try:
        cls = HARMONIZERS[name.lower()]
    except KeyError:
        known = ", ".join(sorted(HARMONIZERS))
        raise ValueError(f"unknown harmonizer {name!r}; choose one of: {known}") from None
    return cls(**options)


__all__ = [
    "CRMOGM",
    "HARMONIZERS",
    "IMTLG",
    "MGDA",
    "PCD",
    "AlignedMTL",
    "CAGrad",
    "ConFIG",
    "CosineGram",
    "DualProj",
    "ExcessMTL",
    "FairGrad",
    "FixedWeights",
    "GradDrop",
    "GradVac",
    "Harmonization",
    "Harmonizer",
    "Krum",
    "Mean",
    "MoDo",
    "NashMTL",
    "PCGrad",
    "RandomWeights",
    "RewardDropout",
    "SDMGrad",
    "TrimmedMean",
    "UPGrad",
    "WeighResult",
    "combine",
    "make_harmonizer",
]
