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
    HARMONIZERS,
    IMTLG,
    MGDA,
    AlignedMTL,
    CAGrad,
    DualProj,
    FixedWeights,
    GradVac,
    Harmonization,
    Harmonizer,
    Mean,
    NashMTL,
    PCGrad,
    RandomWeights,
    RewardDropout,
    UPGrad,
    WeighResult,
    make_harmonizer,
)

__version__ = "0.1.0"

__all__ = [
    "HARMONIZERS",
    "IMTLG",
    "MGDA",
    "AlignedMTL",
    "AmortizedStep",
    "Amortizer",
    "CAGrad",
    "CombinableLoss",
    "ConeQPSolution",
    "ConflictAccumulator",
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
    "SimplexQPSolution",
    "SolverError",
    "UPGrad",
    "UnusedParameterError",
    "WeighResult",
    "WeightEMA",
    "combinable_gradients",
    "conflict_diagnostics",
    "flat_gradient",
    "gram_matrix",
    "make_harmonizer",
    "masked_mean_coefficients",
    "objective_gradients",
    "select_parameters",
    "solve_cone_qp",
    "solve_simplex_qp",
    "write_gradient",
]
