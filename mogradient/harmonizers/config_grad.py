"""ConFIG: the direction at equal cosine to every gradient, as long as their projections."""

from __future__ import annotations

import numpy as np
import torch

from mogradient._gram import CosineGram
from mogradient._qp_cone import near_dependent
from mogradient._span import EIGENVALUE_FLOOR, coordinates_from_stack
from mogradient.harmonizers.base import Harmonizer, WeighResult, validated_preferences
from mogradient.harmonizers.upgrad import preferences_for


class ConFIG(Harmonizer):
    """Conflict-free inverse gradients (Liu, Chu and Thuerey, ConFIG: Towards Conflict-free
    Training of Physics Informed Neural Networks, ICLR 2025; arXiv 2408.11104).

    The update of the paper's Sec. 3 (Method), as the authors' repository tum-pbs/ConFIG
    writes it (README, docs/start/theory.md): with U the stack of unit gradients
    u_k = g_k / ||g_k||, the target t = U^+ p (p = 1 by default, else ``pref_vector``)
    solves u_k . t = p_k, so with p = 1 it makes the same angle with every gradient; the
    update is its unit vector scaled to the sum of the gradients' projections on it:
    d = (sum_k g_k . t / ||t||) t / ||t||. For linearly independent gradients and
    p > 0 every g_k . d > 0: no objective's loss increases to first order.

    On the Gram only: t = U^T a with a = C^+ p (C the cosine matrix), ||t||^2 = a^T C a
    and g_k . t = ||g_k|| (C a)_k, so the raw weights are
    w_k = a_k (sum_i ||g_i|| (C a)_i) / (a^T C a ||g_k||), exact at any spread of norms.
    Eigenvalues of C below 4 K eps of the largest are round-off in a float64 Gram and
    are treated as zero by the pseudo-inverse. With ``refine=True`` (default) and a
    stack given, near-dependent gradients (where a float64 Gram resolves t only to
    ~sqrt(eps)) are solved again on a QR of the unit rows, unit rows^T = Q R:
    t = Q (R^T)^+ p, exact to the stack's precision. If no target remains (p is
    orthogonal to the range of C, e.g. exactly opposed gradients) the weights are zero
    with ``fallback="no_common_direction"``. ``kkt_residual`` is max_k |u_k . t - p_k|
    relative to max p; ``extras["cosines"]`` the cosine of d with each gradient.
    """

    def __init__(
        self, pref_vector: list[float] | torch.Tensor | None = None, refine: bool = True
    ) -> None:
        self.pref_vector = validated_preferences(pref_vector, "pref_vector")
        self.refine_on_stack = bool(refine)

    def weigh(self, gram: CosineGram, objectives: torch.Tensor) -> WeighResult:
        targets = preferences_for(self.pref_vector, objectives).numpy()
        cosines = gram.cosines.numpy()
        eigenvalues, eigenvectors = np.linalg.eigh(cosines)
        keep = eigenvalues > EIGENVALUE_FLOOR * len(targets) * eigenvalues[-1]
        basis = eigenvectors[:, keep]
        coefficients = basis @ ((basis.T @ targets) / eigenvalues[keep])
        products = cosines @ coefficients
        # Norms in units of the largest: the common power of two cancels in the weights.
        return _scaled(targets, coefficients, products, gram.norms.numpy())

    def refine(
        self,
        jacobian: torch.Tensor,
        objectives: torch.Tensor,
        gram: CosineGram,
        weighting: WeighResult,
    ) -> WeighResult | None:
        if not (self.refine_on_stack and near_dependent(gram.cosines.numpy())):
            return None
        basis, coordinates, norms = coordinates_from_stack(jacobian[objectives.to(jacobian.device)])
        targets = preferences_for(self.pref_vector, objectives).numpy()
        cutoff = len(norms) * np.finfo(float).eps
        # t = Q s with R^T s = p (least squares, minimum norm); a with R a = s.
        target = np.linalg.lstsq(coordinates.T, targets, rcond=cutoff)[0]
        coefficients = np.linalg.lstsq(coordinates, target, rcond=cutoff)[0]
        result = _scaled(targets, coefficients, coordinates.T @ target, norms)
        if result.fallback is not None:
            return result
        scale = float(norms @ (coordinates.T @ target)) / float(target @ target)
        direction = basis @ torch.from_numpy(scale * target).to(basis.device)
        return WeighResult(
            result.weights,
            kkt_residual=result.kkt_residual,
            extras={**result.extras, "refined_on_stack": True},
            direction=direction.to(dtype=jacobian.dtype, device=jacobian.device),
        )


def _scaled(
    targets: np.ndarray, coefficients: np.ndarray, products: np.ndarray, norms: np.ndarray
) -> WeighResult:
    """Raw weights for t = sum_k a_k u_k with products u_k . t, scaled so that d has
    length sum_k g_k . t / ||t|| (``norms`` in any common unit)."""
    squared_size = float(coefficients @ products)  # ||t||^2
    if not squared_size > 0:
        return WeighResult(
            torch.zeros(len(targets), dtype=torch.float64), fallback="no_common_direction"
        )
    length = float(norms @ products)
    weights = coefficients * (length / squared_size) / norms
    residual = float(np.abs(products - targets).max() / targets.max())
    signed = np.sign(length) * products / np.sqrt(squared_size)
    return WeighResult(
        torch.from_numpy(weights), kkt_residual=residual, extras={"cosines": signed.tolist()}
    )
