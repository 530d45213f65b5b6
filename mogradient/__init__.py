"""mogradient: exact multi-objective gradient harmonization for PyTorch.

The public API is what this module exports, plus the public modules' own names
(``mogradient.row_gradients``, ``mogradient.distributed``, ...). Modules whose names
start with an underscore (the Gram, the QP solvers) are internal and may change.
"""

from mogradient._gram import CosineGram, gram_matrix
from mogradient._qp import SimplexQPSolution, solve_simplex_qp
from mogradient._qp_cone import ConeQPSolution, solve_cone_qp
from mogradient.amortize import AmortizedStep, Amortizer
from mogradient.combinable import CombinableLoss, masked_mean_coefficients
from mogradient.diagnostics import ConflictAccumulator, conflict_diagnostics
from mogradient.ema import WeightEMA
from mogradient.errors import SolverError, UnusedParameterError
from mogradient.gradients import (
    combinable_gradients,
    flat_gradient,
    objective_gradients,
    select_parameters,
    write_gradient,
)
from mogradient.harmonizers import (
    CRMOGM,
    HARMONIZERS,
    IMTLG,
    MGDA,
    AlignedMTL,
    CAGrad,
    ConFIG,
    DualProj,
    ExcessMTL,
    FairGrad,
    FixedWeights,
    GradDrop,
    GradVac,
    Harmonization,
    Harmonizer,
    Krum,
    Mean,
    MoDo,
    NashMTL,
    PCGrad,
    RandomWeights,
    RewardDropout,
    SDMGrad,
    TrimmedMean,
    UPGrad,
    WeighResult,
    make_harmonizer,
)
from mogradient.representation import mtl_backward
from mogradient.scalarizations import (
    DWA,
    FAMO,
    GLS,
    IMTLL,
    PBI,
    SCALARIZATIONS,
    STCH,
    UW,
    Scalarization,
    ScalarizedLoss,
    make_scalarization,
)

__version__ = "0.1.0"

__all__ = [
    "CRMOGM",
    "DWA",
    "FAMO",
    "GLS",
    "HARMONIZERS",
    "IMTLG",
    "IMTLL",
    "MGDA",
    "PBI",
    "SCALARIZATIONS",
    "STCH",
    "UW",
    "AlignedMTL",
    "AmortizedStep",
    "Amortizer",
    "CAGrad",
    "CombinableLoss",
    "ConFIG",
    "ConeQPSolution",
    "ConflictAccumulator",
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
    "Scalarization",
    "ScalarizedLoss",
    "SimplexQPSolution",
    "SolverError",
    "TrimmedMean",
    "UPGrad",
    "UnusedParameterError",
    "WeighResult",
    "WeightEMA",
    "combinable_gradients",
    "conflict_diagnostics",
    "flat_gradient",
    "gram_matrix",
    "make_harmonizer",
    "make_scalarization",
    "masked_mean_coefficients",
    "mtl_backward",
    "objective_gradients",
    "select_parameters",
    "solve_cone_qp",
    "solve_simplex_qp",
    "write_gradient",
]
