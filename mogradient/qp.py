"""The exact solvers under the harmonizers, for callers who solve their own problems.

- [`gram_matrix`][mogradient.qp.gram_matrix] / [`CosineGram`][mogradient.harmonizers.CosineGram]:
  the Gram of a gradient stack, robust to huge and tiny norms.
- [`solve_simplex_qp`][mogradient.qp.solve_simplex_qp]: min_w w^T G w on the simplex (MGDA's
  problem), to round-off.
- [`solve_cone_qp`][mogradient.qp.solve_cone_qp]: the dual-cone QP of UPGrad and DualProj, to
  round-off.
"""

from mogradient._gram import gram_matrix
from mogradient._qp import SimplexQPSolution, solve_simplex_qp
from mogradient._qp_cone import ConeQPSolution, solve_cone_qp

__all__ = [
    "ConeQPSolution",
    "SimplexQPSolution",
    "gram_matrix",
    "solve_cone_qp",
    "solve_simplex_qp",
]
