"""mogradient: exact multi-objective gradient harmonization for PyTorch.

The top level is what a training loop uses; everything else is one subpackage away:

- [`mogradient.harmonizers`][mogradient.harmonizers]: every harmonizer (``MGDA``, ``PCGrad``,
  ``UPGrad``, ...), by class or by name (``make_harmonizer``, ``HARMONIZERS``);
- [`mogradient.scalarizations`][mogradient.scalarizations]: loss weightings (``FAMO``, ``UW``, ...);
- [`mogradient.engines`][mogradient.engines]: the K x D stack of per-objective gradients (per-row,
  batched, DDP, FSDP2) and writing a direction into ``.grad``;
- [`mogradient.qp`][mogradient.qp]: the exact QP solvers and the robust Gram;
- [`mogradient.registry`][mogradient.registry]: the registry every extension point uses;
- [`mogradient.plotting`][mogradient.plotting]: pictures of conflict, weights and losses (needs
  matplotlib).

Modules whose names start with an underscore are internal and may change.
"""

from mogradient import engines, harmonizers, qp, registry, scalarizations
from mogradient.amortize import AmortizedStep, Amortizer
from mogradient.combinable import CombinableLoss, RowValues, masked_mean_coefficients
from mogradient.diagnostics import ConflictAccumulator, conflict_diagnostics
from mogradient.engines import mtl_backward
from mogradient.errors import SolverError, UnusedParameterError
from mogradient.harmonizers import HARMONIZERS, Harmonization, Harmonizer, make_harmonizer
from mogradient.scalarizations import SCALARIZATIONS, Scalarization, make_scalarization
from mogradient.step import HarmonizedStep, StepReport

__version__ = "0.1.0"

__all__ = [
    "HARMONIZERS",
    "SCALARIZATIONS",
    "AmortizedStep",
    "Amortizer",
    "CombinableLoss",
    "ConflictAccumulator",
    "Harmonization",
    "HarmonizedStep",
    "Harmonizer",
    "RowValues",
    "Scalarization",
    "SolverError",
    "StepReport",
    "UnusedParameterError",
    "conflict_diagnostics",
    "engines",
    "harmonizers",
    "make_harmonizer",
    "make_scalarization",
    "masked_mean_coefficients",
    "mtl_backward",
    "qp",
    "registry",
    "scalarizations",
]
