"""ConFIG: the direction at equal cosine to every gradient, as long as their projections."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from mogradient._gram import CosineGram
from mogradient._qp_cone import near_dependent
from mogradient._span import coordinates_from_stack
from mogradient.harmonizers._base import (
    Harmonizer,
    WeighResult,
    preferences_for,
    validated_flag,
    validated_preferences,
)
from mogradient.harmonizers.promises import (
    LINEAR_UNDER_SCALING,
    NON_CONFLICTING,
    PERMUTATION_INVARIANT,
    STATIONARY_ZERO,
)


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
    Each cosine is known to the Gram's precision eps (``gram.cosine_eps``: the stack's
    dtype, float32 for half types), so eigenvalues of C below 4 K eps of the largest
    are round-off and are treated as zero by the pseudo-inverse. With ``refine=True``
    (default) and a stack given, near-dependent gradients (where a Gram resolves t only
    to ~sqrt(eps)) are solved again on a QR of the unit rows, unit rows^T = Q R:
    t = Q (R^T)^+ p, with singular values of R below K eps (``gram.eps``, the rows'
    dtype) of the largest taken as zero (rounding each row to its dtype moves them that
    much), so rows collinear up to their rounding are collinear.

    If no target makes a positive angle with every gradient of positive preference
    (and none with the others) beyond round-off, the weights are zero with
    ``fallback="no_common_direction"``: p orthogonal to the range of C (exactly opposed
    gradients of any norms), or dependent gradients whose equations u_k . t = p_k are
    inconsistent and whose least-squares target conflicts with one of them (opposed or
    mixed-sign collinear gradients, more gradients than dimensions). Round-off here is
    eps sum_k |a_k|, how far u_k . t moves when each u_j moves by eps. ``kkt_residual``
    is (max_k |u_k . t - p_k| + eps sum_k |a_k|) / max p, the promise's violation by d
    formed in the gradients' precision; ``extras["cosines"]`` the cosine of d with each
    gradient.
    """

    promises: ClassVar[frozenset[str]] = frozenset(
        {NON_CONFLICTING, PERMUTATION_INVARIANT, LINEAR_UNDER_SCALING, STATIONARY_ZERO}
    )
    fallbacks: ClassVar[frozenset[str]] = frozenset({"no_common_direction"})

    def __init__(
        self, pref_vector: list[float] | torch.Tensor | None = None, refine: bool = True
    ) -> None:
        self.pref_vector = validated_preferences(pref_vector, "pref_vector")
        self.refine_on_stack = validated_flag(refine, "refine")

    def weigh(self, gram: CosineGram, objectives: torch.Tensor) -> WeighResult:
        targets = preferences_for(self.pref_vector, objectives).numpy()
        cosines = gram.cosines.numpy()
        eigenvalues, eigenvectors = np.linalg.eigh(cosines)
        # Cosines off by ~eps move C's eigenvalues by up to ~K eps (spectral norm).
        keep = eigenvalues > 4 * gram.cosine_eps * len(targets) * eigenvalues[-1]
        basis = eigenvectors[:, keep]
        coefficients = basis @ ((basis.T @ targets) / eigenvalues[keep])
        products = cosines @ coefficients
        # Norms in units of the largest: the common power of two cancels in the weights.
        return _scaled(targets, coefficients, products, gram.norms.numpy(), gram.eps)

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
        if not np.isfinite(norms).all():
            return None  # a norm beyond float64 (entries near 1e308): the Gram's answer stands
        targets = preferences_for(self.pref_vector, objectives).numpy()
        # Rounding each row to its dtype moves each unit row by <= eps, and the singular
        # values of the K unit rows by <= sqrt(K) eps: below K eps they are round-off.
        cutoff = len(norms) * gram.eps
        # t = Q s with R^T s = p (least squares, minimum norm); a with R a = s.
        target = np.linalg.lstsq(coordinates.T, targets, rcond=cutoff)[0]
        coefficients = np.linalg.lstsq(coordinates, target, rcond=cutoff)[0]
        # In units of the largest norm, as from the Gram: weights near 1e308 / 1e307 stay finite.
        result = _scaled(
            targets, coefficients, coordinates.T @ target, norms / norms.max(), gram.eps
        )
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
    targets: np.ndarray,
    coefficients: np.ndarray,
    products: np.ndarray,
    norms: np.ndarray,
    eps: float,
) -> WeighResult:
    """Raw weights for t = sum_k a_k u_k with products u_k . t, scaled so that d has
    length sum_k g_k . t / ||t|| (``norms`` in any common unit); zero weights with
    ``no_common_direction`` where d would not serve every gradient beyond round-off."""
    squared_size = float(coefficients @ products)  # ||t||^2
    length = float(norms @ products)
    # d is along sign(length) t; u_k . t moves by eps sum_j |a_j| when each u_j moves by eps.
    signed = np.sign(length) * products
    round_off = eps * float(np.abs(coefficients).sum())
    unserved = np.where(targets > 0, signed <= round_off, signed < -round_off)
    if not squared_size > 0 or unserved.any():
        return WeighResult(
            torch.zeros(len(targets), dtype=torch.float64), fallback="no_common_direction"
        )
    weights = coefficients * (length / squared_size) / norms
    residual = (float(np.abs(products - targets).max()) + round_off) / float(targets.max())
    return WeighResult(
        torch.from_numpy(weights),
        kkt_residual=residual,
        extras={"cosines": (signed / np.sqrt(squared_size)).tolist()},
    )
