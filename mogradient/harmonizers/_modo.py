"""MoDo: MGDA's simplex weights tracked by one projected gradient step per call."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np
import torch

from mogradient._gram import CosineGram
from mogradient.harmonizers._base import Harmonizer, WeighResult
from mogradient.harmonizers._simplex import ObjectiveWeights, project_to_simplex


class MoDo(Harmonizer):
    """Multi-objective gradient with double sampling (Chen, Fernando, Ying and Chen,
    Three-Way Trade-Off in Multi-Objective Learning: Optimization, Generalization and
    Conflict-Avoidance, NeurIPS 2023; arXiv 2305.20057).

    Instead of solving MGDA's min-norm problem anew, the weights lambda take one projected
    gradient step per call on 1/2 ||J^T lambda||^2 + rho/2 ||lambda||^2 over the simplex,
    lambda <- Proj(lambda - gamma (J J^T lambda + rho lambda)), and are the weights of the
    update: the two steps of the authors' code (heshandevaka/Trade-Off-MOL,
    LibMTL/LibMTL/weighting/MoDo.py). lambda starts uniform and is kept per objective
    (`ObjectiveWeights`).

    Variant forced by the single-stack contract: the authors' code, and TorchJD's
    ``MoDoWeighting``, form J_1 J_2^T from two independent mini-batches, an unbiased
    estimate of the Gram of the expected gradients. A harmonizer sees one stack, so J J^T
    serves as both; with stochastic gradients it is biased by their covariance (exact for
    full-batch gradients).

    gamma is in units of 1 / |g|^2: the update, the authors' and TorchJD's, is not
    scale-invariant (large gradients send lambda to a vertex in one step, tiny ones leave
    it in place). It is evaluated exactly at any scale: G lambda is formed in each
    gradient's units and scaled back entrywise; where gamma G lambda overflows float64
    (gradients beyond ~1e154) lambda is its limit, the projection of
    (1 - gamma rho) lambda onto the face of the simplex where G lambda is least.
    Defaults follow TorchJD and the authors' code (gamma 0.1, rho 0.1).
    """

    keeps_objective_state: ClassVar[bool] = True

    def __init__(self, gamma: float = 0.1, rho: float = 0.1) -> None:
        if not (math.isfinite(gamma) and gamma > 0.0):
            raise ValueError(f"gamma must be finite and positive, got {gamma}")
        if not (math.isfinite(rho) and rho >= 0.0):
            raise ValueError(f"rho must be finite and non-negative, got {rho}")
        self.gamma = float(gamma)
        self.rho = float(rho)
        self._lambda = ObjectiveWeights()

    def reset(self) -> None:
        """Forget lambda (start of a new run): the next call starts from uniform weights."""
        super().reset()
        self._lambda = ObjectiveWeights()

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "lambda": dict(self._lambda.values)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._lambda.values = dict(state.get("lambda", {}))

    def weigh(self, gram: CosineGram, objectives: torch.Tensor) -> WeighResult:
        names = [int(index) for index in objectives]
        current = self._lambda.of(names)
        # (G lambda)_k / 4^exponent = n_k (C (n * lambda))_k: no product of two small norms.
        product = gram.norms * (gram.cosines @ (gram.norms * current))
        with np.errstate(over="ignore"):
            step = np.ldexp(self.gamma * product.numpy(), 2 * gram.exponent)
        kept = (1.0 - self.gamma * self.rho) * current
        moved = kept - torch.from_numpy(step)
        if torch.isfinite(moved).all():
            weights = project_to_simplex(moved)
        else:
            face = product == product.min()
            weights = torch.zeros_like(current)
            weights[face] = project_to_simplex(kept[face])
        self._lambda.set(names, weights)
        return WeighResult(weights)
