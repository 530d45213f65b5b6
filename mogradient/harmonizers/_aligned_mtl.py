"""Aligned-MTL: make the gradient system well-conditioned before combining it."""

from __future__ import annotations

from typing import ClassVar

import torch

from mogradient._gram import CosineGram
from mogradient.harmonizers._base import (
    Harmonizer,
    WeighResult,
    preferences_for,
    validated_preferences,
)
from mogradient.harmonizers.promises import LINEAR_UNDER_SCALING, PERMUTATION_INVARIANT

_SCALE_MODES = ("min", "median", "rmse")


class AlignedMTL(Harmonizer):
    """Well-conditioned gradient alignment (Senushkin et al. 2023, Independent Component Alignment).

    With G = V diag(lambda) V^T (the R non-zero eigenvalues), the aligned gradients are
    J_hat^T = J^T B with B = sqrt(sigma) V diag(lambda)^(-1/2) V^T: they are orthogonal
    with equal norms (condition number one), so no objective dominates. The direction is
    J_hat^T p, i.e. raw weights B p, with p the preferences (default 1/K, as TorchJD;
    the paper sums, which is K times larger). ``scale_mode`` picks sigma: the smallest
    non-zero eigenvalue (``"min"``, the paper's choice), the median, or the mean
    (``"rmse"``, as in the authors' code). Eigenvalues below max(lambda) * K * eps count
    as zero.
    """

    promises: ClassVar[frozenset[str]] = frozenset({PERMUTATION_INVARIANT, LINEAR_UNDER_SCALING})

    def __init__(
        self,
        pref_vector: list[float] | torch.Tensor | None = None,
        scale_mode: str = "min",
    ) -> None:
        if scale_mode not in _SCALE_MODES:
            raise ValueError(f"scale_mode must be one of {_SCALE_MODES}, got {scale_mode!r}")
        self.pref_vector = validated_preferences(pref_vector, "pref_vector")
        self.scale_mode = scale_mode

    def weigh(self, gram: CosineGram, objectives: torch.Tensor) -> WeighResult:
        preferences = preferences_for(self.pref_vector, objectives)
        # Gradients below ~1e-154 of the largest underflow here: below this method's own
        # rank tolerance (K eps of the largest eigenvalue) they count as zero anyway.
        eigenvalues, eigenvectors = torch.linalg.eigh(gram.matrix())
        tolerance = eigenvalues.max() * len(gram) * torch.finfo(torch.float64).eps
        kept = eigenvalues > tolerance
        eigenvalues, eigenvectors = eigenvalues[kept], eigenvectors[:, kept]
        if self.scale_mode == "min":
            sigma = eigenvalues.min()
        elif self.scale_mode == "median":
            # torch.median takes the lower middle value for an even count, as TorchJD does.
            sigma = torch.median(eigenvalues)
        else:
            sigma = eigenvalues.mean()
        balance = sigma.sqrt() * (eigenvectors / eigenvalues.sqrt()) @ eigenvectors.T
        weights = balance @ preferences
        return WeighResult(
            weights,
            extras={
                "rank": int(kept.sum()),
                "condition_number": float(eigenvalues.max() / eigenvalues.min()),
            },
        )
