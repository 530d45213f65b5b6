"""Scalarizations: K task losses (with graph) -> one loss to backpropagate, and its weights.

Every scalarization is imported from here (its module is private) and registered once,
below, in `SCALARIZATIONS`, named by the rule in [`mogradient.harmonizers`][mogradient.harmonizers]
(IMTL-L -> ``imtl_l``, GradNorm -> ``grad_norm``, DB-MTL -> ``db_mtl``, MoCo -> ``moco``);
earlier spellings stay aliases.
"""

from __future__ import annotations

from typing import Any

from mogradient.registry import Registry
from mogradient.scalarizations._base import Scalarization, ScalarizedLoss
from mogradient.scalarizations._cosmos import COSMOS
from mogradient.scalarizations._db_mtl import DBMTL
from mogradient.scalarizations._dwa import DWA
from mogradient.scalarizations._famo import FAMO
from mogradient.scalarizations._gls import GLS
from mogradient.scalarizations._grad_norm import GradNorm
from mogradient.scalarizations._imtl import IMTL
from mogradient.scalarizations._imtl_l import IMTLL
from mogradient.scalarizations._moco import MoCo
from mogradient.scalarizations._pbi import PBI
from mogradient.scalarizations._stch import STCH
from mogradient.scalarizations._uw import UW

SCALARIZATIONS: Registry[type[Scalarization]] = Registry("scalarization")
SCALARIZATIONS.add("uw", UW)
SCALARIZATIONS.add("dwa", DWA)
SCALARIZATIONS.add("gls", GLS)
SCALARIZATIONS.add("imtl_l", IMTLL, aliases=["imtll"])
SCALARIZATIONS.add("stch", STCH)
SCALARIZATIONS.add("pbi", PBI)
SCALARIZATIONS.add("famo", FAMO)
SCALARIZATIONS.add("grad_norm", GradNorm, aliases=["gradnorm"])
SCALARIZATIONS.add("db_mtl", DBMTL, aliases=["dbmtl"])
SCALARIZATIONS.add("imtl", IMTL)
SCALARIZATIONS.add("moco", MoCo)
SCALARIZATIONS.add("cosmos", COSMOS)


def make_scalarization(name: str, **options: Any) -> Scalarization:
    """Build a scalarization by registry name or alias (``uw``, ``famo``, ``db_mtl``, ...);
    an unknown name raises [`UnknownNameError`][mogradient.registry.UnknownNameError] (a
    ValueError)."""
    return SCALARIZATIONS[name](**options)


__all__ = [
    "COSMOS",
    "DBMTL",
    "DWA",
    "FAMO",
    "GLS",
    "IMTL",
    "IMTLL",
    "PBI",
    "SCALARIZATIONS",
    "STCH",
    "UW",
    "GradNorm",
    "MoCo",
    "Scalarization",
    "ScalarizedLoss",
    "make_scalarization",
]
