"""IMTL-G: the direction whose projection onto every unit gradient is the same."""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from mogradient._gram import CosineGram
from mogradient.harmonizers._base import Harmonizer, WeighResult
from mogradient.harmonizers.promises import LINEAR_UNDER_SCALING, PERMUTATION_INVARIANT


class IMTLG(Harmonizer):
    """Impartial gradient weighting (Liu et al. 2021, Towards Impartial Multi-task Learning).

    IMTL-G picks d = sum_k w_k g_k with sum_k w_k = 1 and d . u_k equal for every unit
    gradient u_k = g_k / ||g_k||. On the Gram matrix: G v = (||g_k||)_k, w = v / sum(v).
    For independent gradients we solve it through the cosine matrix C (G = N C N,
    N = diag ||g_k||: v = N^-1 C^-1 1), which stays well-conditioned when norms differ
    by orders of magnitude. With linearly dependent gradients G is singular and we use
    v = pinv(G) (||g_k||)_k, the generalization of Quinton & Rey (2024) and TorchJD;
    then the projections are equal only in the least-squares sense (``kkt_residual``
    reports their relative spread).

    Two degenerate cases the paper leaves open: if sum(v) is zero (relative to |v|) the
    weights are zero (``fallback="degenerate"``, as TorchJD does); if sum(v) < 0, the
    paper's normalization would flip d into an ascent direction for every objective, so
    we divide by |sum(v)| instead (``fallback="negative_sum"``), keeping the common
    projection positive.
    """

    promises: ClassVar[frozenset[str]] = frozenset({PERMUTATION_INVARIANT, LINEAR_UNDER_SCALING})
    fallbacks: ClassVar[frozenset[str]] = frozenset({"degenerate", "negative_sum"})

    def weigh(self, gram: CosineGram, objectives: torch.Tensor) -> WeighResult:
        count = len(gram)
        norms, cosines = gram.norms, gram.cosines
        eigenvalues, eigenvectors = torch.linalg.eigh(cosines)
        tolerance = eigenvalues.max() * count * torch.finfo(torch.float64).eps
        if eigenvalues.min() > 1e3 * tolerance:
            # Full rank: G v = norms  <=>  C (norms * v) = 1 with C the cosine matrix,
            # which stays well-conditioned when the gradients' norms differ wildly.
            unit = eigenvectors @ (
                (eigenvectors.T @ torch.ones(count, dtype=torch.float64)) / eigenvalues
            )
            coefficients = unit / norms
            magnitude = (unit.abs() / norms).sum()
        else:
            # Linearly dependent gradients: the pseudo-inverse generalization.
            inverse = torch.linalg.pinv(gram.matrix(), hermitian=True)
            coefficients = inverse @ norms
            magnitude = math.sqrt(count) * norms.norm() * torch.linalg.matrix_norm(inverse, 2)
        total = coefficients.sum()
        projections = cosines @ (coefficients * norms)
        spread = (projections - projections.mean()).abs().max()
        residual = float(spread / projections.abs().max()) if spread > 0 else 0.0
        if total.abs() <= 1e-10 * magnitude:
            return WeighResult(
                torch.zeros_like(coefficients), kkt_residual=residual, fallback="degenerate"
            )
        fallback = "negative_sum" if total < 0 else None
        return WeighResult(coefficients / total.abs(), kkt_residual=residual, fallback=fallback)
