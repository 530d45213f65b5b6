"""Harmonizers: per-objective gradients (or their Gram) -> weights on the raw gradients.

Every harmonizer is imported from here (its module is private) and registered once, below,
in `HARMONIZERS`, under a canonical name that this rule derives from the method's
name as its authors write it (the same rule names scalarizations): lower snake case, split
into words where the name has separate words (a hyphen, a space, or a capital that starts
a new word after a lowercase letter: Nash-MTL -> ``nash_mtl``, IMTL-G -> ``imtl_g``,
GradVac -> ``grad_vac``, FairGrad -> ``fair_grad``), while a one-word name stays one word,
capitals inside an acronym included (MGDA -> ``mgda``, PCGrad -> ``pcgrad``, UPGrad ->
``upgrad``, ConFIG -> ``config``, MoDo -> ``modo``). Earlier spellings (``nashmtl``) stay
aliases, so configs and saved runs that use them keep working.
"""

from __future__ import annotations

from typing import Any

from mogradient._gram import CosineGram
from mogradient.harmonizers._aligned_mtl import AlignedMTL
from mogradient.harmonizers._base import (
    Harmonization,
    Harmonizer,
    WeighResult,
    combine,
    zero_in_hull,
)
from mogradient.harmonizers._cagrad import CAGrad
from mogradient.harmonizers._config_grad import ConFIG
from mogradient.harmonizers._cr_mogm import CRMOGM
from mogradient.harmonizers._dropout import RewardDropout
from mogradient.harmonizers._dual_proj import DualProj
from mogradient.harmonizers._excess_mtl import ExcessMTL
from mogradient.harmonizers._fair_grad import FairGrad
from mogradient.harmonizers._grad_drop import GradDrop
from mogradient.harmonizers._grad_vac import GradVac
from mogradient.harmonizers._imtl_g import IMTLG
from mogradient.harmonizers._krum import Krum
from mogradient.harmonizers._mgda import MGDA
from mogradient.harmonizers._modo import MoDo
from mogradient.harmonizers._nash_mtl import NashMTL
from mogradient.harmonizers._pcd import PCD
from mogradient.harmonizers._pcgrad import PCGrad
from mogradient.harmonizers._sdmgrad import SDMGrad
from mogradient.harmonizers._trimmed_mean import TrimmedMean
from mogradient.harmonizers._upgrad import SlowSolveWarning, UPGrad
from mogradient.harmonizers._weighted import FixedWeights, Mean, RandomWeights
from mogradient.registry import Registry

HARMONIZERS: Registry[type[Harmonizer]] = Registry("harmonizer")
HARMONIZERS.add("mgda", MGDA)
HARMONIZERS.add("pcgrad", PCGrad)
HARMONIZERS.add("fixed", FixedWeights)
HARMONIZERS.add("mean", Mean)
HARMONIZERS.add("rlw", RandomWeights)
HARMONIZERS.add("cagrad", CAGrad)
HARMONIZERS.add("nash_mtl", NashMTL, aliases=["nashmtl"])
HARMONIZERS.add("upgrad", UPGrad)
HARMONIZERS.add("dual_proj", DualProj, aliases=["dualproj"])
HARMONIZERS.add("imtl_g", IMTLG, aliases=["imtlg"])
HARMONIZERS.add("aligned_mtl", AlignedMTL, aliases=["alignedmtl"])
HARMONIZERS.add("grad_vac", GradVac, aliases=["gradvac"])
HARMONIZERS.add("config", ConFIG)
HARMONIZERS.add("fair_grad", FairGrad, aliases=["fairgrad"])
HARMONIZERS.add("krum", Krum)
HARMONIZERS.add("trimmed_mean", TrimmedMean, aliases=["trimmedmean"])
HARMONIZERS.add("grad_drop", GradDrop, aliases=["graddrop"])
HARMONIZERS.add("excess_mtl", ExcessMTL, aliases=["excessmtl"])
HARMONIZERS.add("cr_mogm", CRMOGM, aliases=["crmogm"])
HARMONIZERS.add("modo", MoDo)
HARMONIZERS.add("sdmgrad", SDMGrad)
HARMONIZERS.add("pcd", PCD)


def make_harmonizer(name: str, **options: Any) -> Harmonizer:
    """Build a harmonizer by registry name or alias (``mgda``, ``nash_mtl``, ``upgrad``, ...);
    an unknown name raises [`UnknownNameError`][mogradient.registry.UnknownNameError] (a
    ValueError).

    A wrapper's ``inner`` harmonizer (CR-MOGM's) may be given by its registry name too.
    """
    if isinstance(options.get("inner"), str):
        options = {**options, "inner": make_harmonizer(options["inner"])}
    return HARMONIZERS[name](**options)


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
    "SlowSolveWarning",
    "TrimmedMean",
    "UPGrad",
    "WeighResult",
    "combine",
    "make_harmonizer",
    "zero_in_hull",
]
