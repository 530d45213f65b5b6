"""Scalarizations: K task losses (with graph) -> one loss to backpropagate, and its weights."""

from __future__ import annotations

from typing import Any

from mogradient.scalarizations.base import Scalarization, ScalarizedLoss
from mogradient.scalarizations.cosmos import COSMOS
from mogradient.scalarizations.db_mtl import DBMTL
from mogradient.scalarizations.dwa import DWA
from mogradient.scalarizations.famo import FAMO
from mogradient.scalarizations.gls import GLS
from mogradient.scalarizations.gradnorm import GradNorm
from mogradient.scalarizations.imtl import IMTL
from mogradient.scalarizations.imtll import IMTLL
from mogradient.scalarizations.moco import MoCo
from mogradient.scalarizations.pbi import PBI
from mogradient.scalarizations.stch import STCH
from mogradient.scalarizations.uw import UW

SCALARIZATIONS: dict[str, type[Scalarization]] = {
    "uw": UW,
    "dwa": DWA,
    "gls": GLS,
    "imtll": IMTLL,
    "stch": STCH,
    "pbi": PBI,
    "famo": FAMO,
    "gradnorm": GradNorm,
    "dbmtl": DBMTL,
    "imtl": IMTL,
    "moco": MoCo,
    "cosmos": COSMOS,
}


def make_scalarization(name: str, **options: Any) -> Scalarization:
    """Build a scalarization by registry name (``uw``, ``famo``, ``stch``, ...)."""
    try:
        cls = SCALARIZATIONS[name.lower()]
    except KeyError:
        known = ", ".join(sorted(SCALARIZATIONS))
        raise ValueError(f"unknown scalarization {name!r}; choose one of: {known}") from None
    return cls(**options)


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
