"""UPGrad: average of every gradient's projection onto the dual cone of all gradients."""

from __future__ import annotations

import time
import warnings
from typing import ClassVar

import numpy as np
import torch

from mogradient._gram import CosineGram
from mogradient._qp_cone import solve_cone_qps_factored
from mogradient.harmonizers._base import (
    Harmonizer,
    WeighResult,
    preferences_for,
    validated_flag,
    validated_preferences,
)
from mogradient.harmonizers._dual_cone import cone_problem, refined_on_stack, validated_reg_eps
from mogradient.harmonizers.promises import (
    LINEAR_UNDER_SCALING,
    NON_CONFLICTING,
    PERMUTATION_INVARIANT,
    STATIONARY_ZERO,
)

# A UPGrad solve slower than this warns, once per instance.
SLOW_SOLVE_SECONDS = 1.0


class SlowSolveWarning(UserWarning):
    """A harmonizer's solve took long enough to dominate a training step."""


class UPGrad(Harmonizer):
    """Unconflicting projection of gradients (Quinton & Rey 2024, Jacobian Descent for MOO).

    Each gradient g_i, scaled by its preference p_i (default 1/K), is projected onto the
    dual cone {d : g_k . d >= 0 for all k}; the direction is the sum of the projections,
    so it conflicts with no objective. On the Gram matrix the projection of p_i g_i is
    J^T v_i with v_i = argmin v^T G v s.t. v >= p_i e_i, and the weights are sum_i v_i.
    Every QP is solved exactly, all K together on one factorization of the Gram
    (`mogradient._qp_cone.solve_cone_qps_factored`; each answer certified by its KKT
    residual, the uncertified ones solved one by one). That takes ~0.25 s at K = 256 on
    well-conditioned Grams but seconds from K = 128 on ill-conditioned or low-rank ones
    (docs/core/methods.md, "UPGrad at large K"): a solve over ``SLOW_SOLVE_SECONDS``
    warns once per instance ([`SlowSolveWarning`][mogradient.harmonizers.SlowSolveWarning]).

    ``reg_eps > 0`` reproduces TorchJD's default projector, which solves the QP on
    G / trace(G) + reg_eps * I (TorchJD uses 1e-4); the default 0 is the exact method.
    With ``refine=True`` (default) and a gradient stack given, near-dependent gradients
    are re-solved in exact span coordinates from a QR of the stack
    (`mogradient._span.coordinates_from_stack`, one O(D K^2) factorization);
    ``refine=False`` keeps the Gram-only solve, cheaper for huge D.
    """

    promises: ClassVar[frozenset[str]] = frozenset(
        {NON_CONFLICTING, PERMUTATION_INVARIANT, LINEAR_UNDER_SCALING, STATIONARY_ZERO}
    )

    def __init__(
        self,
        pref_vector: list[float] | torch.Tensor | None = None,
        reg_eps: float = 0.0,
        backend: str = "builtin",
        refine: bool = True,
    ) -> None:
        self.pref_vector = validated_preferences(pref_vector, "pref_vector")
        self.reg_eps = validated_reg_eps(reg_eps)
        self.backend = backend
        self.refine_on_stack = validated_flag(refine, "refine")

    def weigh(self, gram: CosineGram, objectives: torch.Tensor) -> WeighResult:
        started = time.perf_counter()
        cosines, norms = cone_problem(gram, self.reg_eps)
        lowers = self._lowers(objectives)
        weights = np.zeros(len(objectives))
        residual = 0.0
        for solution in solve_cone_qps_factored(cosines, norms, lowers, backend=self.backend):
            weights += solution.weights
            residual = max(residual, solution.kkt_residual)
        self._warn_if_slow(len(objectives), time.perf_counter() - started)
        return WeighResult(torch.from_numpy(weights), kkt_residual=residual)

    def refine(
        self,
        jacobian: torch.Tensor,
        objectives: torch.Tensor,
        gram: CosineGram,
        weighting: WeighResult,
    ) -> WeighResult | None:
        started = time.perf_counter()
        refined = refined_on_stack(self, jacobian, objectives, gram, self._lowers(objectives))
        self._warn_if_slow(len(objectives), time.perf_counter() - started)
        return refined

    def _lowers(self, objectives: torch.Tensor) -> np.ndarray:
        """One QP's lower bound p_i e_i per row, for the objectives with p_i > 0 (for
        p_i = 0, min v^T G v over v >= 0 is v = 0)."""
        preferences = preferences_for(self.pref_vector, objectives).numpy()
        return np.diag(preferences)[preferences != 0]

    def _warn_if_slow(self, count: int, seconds: float) -> None:
        """Warn once per instance when a solve took over ``SLOW_SOLVE_SECONDS``."""
        if seconds <= SLOW_SOLVE_SECONDS or getattr(self, "_warned_slow", False):
            return
        self._warned_slow = True
        warnings.warn(
            f"UPGrad took {seconds:.1f} s to project K = {count} gradients onto their dual "
            "cone (K QPs of size K). Well-conditioned Grams take ~0.25 s at K = 256; "
            "ill-conditioned or low-rank ones leave most QPs to the exact one-by-one solver: "
            "seconds from K = 128, minutes at K = 256 (docs/core/methods.md, 'UPGrad at "
            "large K'). Consider MGDA (one QP) or a smaller K (fewer objectives, a smaller "
            "batch for instance-wise Grams).",
            SlowSolveWarning,
            stacklevel=2,
        )
