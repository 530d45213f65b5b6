"""mogradient: exact multi-objective gradient harmonization for PyTorch."""

from mogradient.amortize import AmortizedStep, Amortizer
from mogradient.diagnostics import ConflictAccumulator, conflict_diagnostics
from mogradient.ema import WeightEMA
from mogradient.gradients import (
    combinable_gradients,
    objective_gradients,
    select_parameters,
    write_gradient,
)
from mogradient.gram import gram_matrix
from mogradient.harmonizers import (
    HARMONIZERS,
    MGDA,
    FixedWeights,
    Harmonization,
    Harmonizer,
    Mean,
    PCGrad,
    RandomWeights,
    RewardDropout,
    make_harmonizer,
)
from mogradient.objectives import CombinableLoss, masked_mean_coefficients
from mogradient.qp import SimplexQPSolution, solve_simplex_qp

__version__ = "0.1.0"

__all__ = [
    "HARMONIZERS",
    "MGDA",
    "AmortizedStep",
    "Amortizer",
    "CombinableLoss",
    "ConflictAccumulator",
    "FixedWeights",
    "Harmonization",
    "Harmonizer",
    "Mean",
    "PCGrad",
    "RandomWeights",
    "RewardDropout",
    "SimplexQPSolution",
    "WeightEMA",
    "combinable_gradients",
    "conflict_diagnostics",
    "gram_matrix",
    "make_harmonizer",
    "masked_mean_coefficients",
    "objective_gradients",
    "select_parameters",
    "solve_simplex_qp",
    "write_gradient",
]
