"""Coordinates of K gradients in their own span: from the Gram, or exactly from the stack.

Methods that need geometry beyond inner products (projections onto faces, min-norm
points) work on a K-column matrix A whose columns have the gradients' unit vectors'
inner products. From the cosine matrix, A = sqrt(Lambda) V^T (eigen-decomposition);
from the stack, A = R of a QR of the unit rows, exact to the stack's own precision when
the gradients are near-dependent, where a float64 Gram has lost the digits that matter.
"""

from __future__ import annotations

import numpy as np
import torch

# Eigenvalues of a unit-diagonal Gram below this x K x the largest are round-off.
EIGENVALUE_FLOOR = 4 * np.finfo(float).eps


def coordinates_from_cosines(cosines: np.ndarray) -> np.ndarray:
    """A (r x K) with A^T A = cosines, dropping eigenvalues at round-off level.

    Entries of a float64 unit-diagonal Gram carry relative error ~eps, so eigenvalues
    below ~K eps of the largest are indistinguishable from zero: those directions are
    dropped, which makes numerically dependent gradients exactly dependent.
    """
    eigenvalues, eigenvectors = np.linalg.eigh(0.5 * (cosines + cosines.T))
    floor = EIGENVALUE_FLOOR * len(cosines) * max(float(eigenvalues[-1]), 0.0)
    keep = eigenvalues > floor
    return np.sqrt(eigenvalues[keep])[:, None] * eigenvectors[:, keep].T


def coordinates_from_stack(rows: torch.Tensor) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """(basis Q: D x r, coordinates R: r x K, norms: K) with unit rows^T = Q R, float64.

    Rows must be finite and non-zero. Norms are taken as (largest entry) x (norm of the
    row divided by it), so rows near the ends of the dtype's range neither under- nor
    overflow. Costs a float64 copy of the rows and a Householder QR (O(D K^2)); the
    basis stays a tensor on the rows' device.
    """
    values = rows.detach().to(torch.float64)
    peaks = torch.linalg.vector_norm(values, ord=float("inf"), dim=1)
    units = values / peaks[:, None]
    sizes = torch.linalg.vector_norm(units, dim=1)
    units /= sizes[:, None]
    basis, coordinates = torch.linalg.qr(units.T)
    return basis, coordinates.cpu().numpy(), (sizes * peaks).cpu().numpy()
