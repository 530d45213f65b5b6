"""GradVac: PCGrad-like corrections towards per-pair EMA cosine-similarity targets."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from mogradient._gram import CosineGram
from mogradient.harmonizers._base import Harmonizer, WeighResult, seeded_generator


class GradVac(Harmonizer):
    """Gradient vaccine (Wang et al. 2021, Gradient Vaccine: Improving Multi-task Optimization).

    For each objective i and every other j in random order, if the cosine phi between the
    (already corrected) g_i and g_j is below the target phi_hat_ij, g_i gets the smallest
    multiple of g_j that lifts the cosine to the target:
    g_i += g_j ||g_i|| (phi_hat sqrt(1 - phi^2) - phi sqrt(1 - phi_hat^2))
    / (||g_j|| sqrt(1 - phi_hat^2)); then phi_hat_ij <- (1 - beta) phi_hat_ij + beta phi.
    The direction is the sum of the corrected gradients. Targets start at 0 (which makes
    the first step PCGrad-like) and are kept per ordered pair of the caller's objective
    indices, so they survive objectives being dropped for a step;
    [`reset`][mogradient.harmonizers.GradVac.reset] clears them. Everything is tracked as
    coefficients on the raw gradients through the Gram matrix (normalized by its largest diagonal,
    which leaves the weights unchanged).

    ``beta`` defaults to 1e-2 (the paper's setting; TorchJD and LibMTL default to 0.5).
    ``eps`` guards denominators, as TorchJD's, but relative to the largest gradient norm.
    The visiting order is drawn from a generator seeded with ``seed``.
    """

    keeps_objective_state: ClassVar[bool] = True

    randomized: ClassVar[bool] = True

    def __init__(self, beta: float = 0.01, eps: float = 1e-8, seed: int | None = None) -> None:
        if not (math.isfinite(beta) and 0.0 <= beta <= 1.0):
            raise ValueError(f"beta must be in [0, 1], got {beta}")
        if not (math.isfinite(eps) and eps >= 0.0):
            raise ValueError(f"eps must be finite and non-negative, got {eps}")
        self.beta = float(beta)
        self.eps = float(eps)
        self.seed = seed
        self._generator = seeded_generator(seed)
        self._targets: dict[tuple[int, int], float] = {}

    def reset(self) -> None:
        """Forget the EMA targets (start of a new run)."""
        super().reset()
        self._targets.clear()

    @property
    def targets(self) -> dict[tuple[int, int], float]:
        """Current EMA cosine targets, keyed by (objective i, objective j) original indices."""
        return dict(self._targets)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "targets": dict(self._targets)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._targets = dict(state.get("targets", {}))

    def weigh(self, gram: CosineGram, objectives: torch.Tensor) -> WeighResult:
        count = len(objectives)
        names = [int(index) for index in objectives]
        # Gradients below ~1e-154 of the largest underflow here: eps (relative to the
        # largest norm) already makes their corrections vanish.
        norms = gram.norms / gram.norms.max()
        gram = gram.cosines * torch.outer(norms, norms)
        coefficients = torch.eye(count, dtype=torch.float64)
        corrections = 0
        for task in range(count):
            # products[j] = (corrected g_task) . g_j
            products = coefficients[task] @ gram
            others = [other for other in range(count) if other != task]
            order = torch.randperm(len(others), generator=self._generator).tolist()
            for other in (others[index] for index in order):
                own_norm = float(torch.sqrt((products @ coefficients[task]).clamp_min(0)))
                other_norm = float(norms[other])
                cosine = float(products[other]) / (own_norm * other_norm + self.eps)
                key = (names[task], names[other])
                target = self._targets.get(key, 0.0)
                if cosine < target:
                    sine = math.sqrt(max(1.0 - cosine * cosine, 0.0))
                    target_sine = math.sqrt(max(1.0 - target * target, 0.0))
                    step = (
                        own_norm
                        * (target * sine - cosine * target_sine)
                        / (other_norm * target_sine + self.eps)
                    )
                    coefficients[task, other] += step
                    products = products + step * gram[other]
                    corrections += 1
                self._targets[key] = (1.0 - self.beta) * target + self.beta * cosine
        return WeighResult(coefficients.sum(dim=0), extras={"corrections": corrections})
