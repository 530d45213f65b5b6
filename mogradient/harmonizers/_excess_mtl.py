"""ExcessMTL: more weight to the objectives that are further from their own optimum."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from mogradient._gram import CosineGram
from mogradient.harmonizers._base import Harmonization, Harmonizer, WeighResult
from mogradient.harmonizers._simplex import ObjectiveWeights

_LARGEST = torch.finfo(torch.float64).max


class ExcessMTL(Harmonizer):
    """Excess-risk weighting (He, Zhou, Zhang, Yun, Xu, Zeng, Chilimbi and Zhao, Robust
    Multi-Task Learning with Excess Risks, ICML 2024; arXiv 2402.02009).

    Objective k's excess risk (its loss above its own optimum) is estimated from a local
    quadratic model, E_k = g_k^T H_k^-1 g_k with H_k = diag(sqrt(sum_t g_(k,t)^2)) the
    AdaGrad diagonal of its gradients so far, and divided by its value at the start,
    which makes objectives of any scale comparable. The weights take one
    exponentiated-gradient step on the simplex, lambda_k <- lambda_k exp(eta r_k),
    renormalized (``step_size`` is eta). All three steps are those of the authors' code
    (yifei-he/ExcessMTL, LibMTL/LibMTL/weighting/ExcessMTL.py), which renormalizes the
    weights to sum to K where these sum to 1. During the first ``warmup_steps`` calls the
    weights stay uniform and each objective's estimates are averaged into its baseline;
    ``warmup_steps=1`` is the authors' code's schedule (its baseline is the first call's
    estimate, its first update the second call's).

    Not Gram-only: H_k is per parameter, so the method reads the stack itself. Calling it
    with ``gram=`` raises, and so does a wrapper that calls `weigh` without the stack.

    State, per objective in the caller's numbering: lambda, the root of its accumulated
    squared gradients sqrt(sum_t g_(k,t)^2) (a D-long vector in the stack's dtype and on its
    device, K D entries in all as in TorchJD; the width D must stay the same), and its
    warm-up sums and baseline; an objective first seen after the warm-up takes its first
    estimate as baseline.

    Differences from TorchJD 0.18's ``ExcessMTLWeighting``: (i) its default
    ``n_warmup_steps=0`` updates on the first call with the raw estimate, a quantity
    in units of the gradient, so the weights depend on the gradients' scale and saturate
    to a vertex, for good, once gradients are large. Every update here uses the normalized
    estimate, with a warm-up of at least one call: ``warmup_steps=n`` equals TorchJD's
    ``n_warmup_steps=n`` for n >= 1 (the default 1 is its 1). (ii) TorchJD adds 1e-7 under
    the square root of H (as the authors' code does) and to the baseline, absolute guards
    that make it scale-dependent. Neither is needed: g_kj^2 / H_kj <= |g_kj| is taken as 0
    where H_kj is 0, the root is accumulated with hypot (no squares to over- or underflow),
    and a usable objective's baseline is positive. The weights are thus exactly invariant
    to each objective's scale.
    """

    needs_stack = True
    keeps_objective_state: ClassVar[bool] = True

    def __init__(self, step_size: float = 1.0, warmup_steps: int = 1) -> None:
        if not (math.isfinite(step_size) and step_size > 0.0):
            raise ValueError(f"step_size must be finite and positive, got {step_size}")
        if int(warmup_steps) != warmup_steps or warmup_steps < 1:
            raise ValueError(f"warmup_steps must be an integer >= 1, got {warmup_steps}")
        self.step_size = float(step_size)
        self.warmup_steps = int(warmup_steps)
        self.reset()
        self._stack: torch.Tensor | None = None

    def reset(self) -> None:
        """Forget all state (start of a new run): uniform weights and a new warm-up."""
        super().reset()
        self.step = 0
        self._lambda = ObjectiveWeights()
        self._roots: dict[int, torch.Tensor] = {}
        self._warmup_sums: dict[int, float] = {}
        self._warmup_counts: dict[int, int] = {}
        self._baselines: dict[int, float] = {}

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "step": self.step,
            "lambda": dict(self._lambda.values),
            "roots": {name: root.clone() for name, root in self._roots.items()},
            "warmup_sums": dict(self._warmup_sums),
            "warmup_counts": dict(self._warmup_counts),
            "baselines": dict(self._baselines),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.step = int(state["step"])
        self._lambda.values = dict(state["lambda"])
        self._roots = {name: root.clone() for name, root in state["roots"].items()}
        self._warmup_sums = dict(state["warmup_sums"])
        self._warmup_counts = dict(state["warmup_counts"])
        self._baselines = dict(state["baselines"])

    def __call__(
        self, jacobian: torch.Tensor | None = None, *, gram: torch.Tensor | None = None
    ) -> Harmonization:
        if jacobian is None:
            raise ValueError(
                "ExcessMTL needs the gradient stack: its excess-risk estimate divides every "
                "entry by that parameter's AdaGrad scale, which a Gram matrix does not hold"
            )
        self._stack = jacobian
        try:
            return super().__call__(jacobian, gram=gram)
        finally:
            self._stack = None

    def weigh(self, gram: CosineGram, objectives: torch.Tensor) -> WeighResult:
        if self._stack is None:
            raise ValueError("ExcessMTL reads the gradient stack: call it on the stack")
        names = [int(index) for index in objectives]
        estimates = [self._excess_risk(name, self._stack[name].detach()) for name in names]
        weights = self._lambda.of(names)
        self.step += 1
        if self.step <= self.warmup_steps:
            for name, estimate in zip(names, estimates, strict=True):
                self._warmup_sums[name] = self._warmup_sums.get(name, 0.0) + estimate
                self._warmup_counts[name] = self._warmup_counts.get(name, 0) + 1
            self._lambda.set(names, weights)
            return WeighResult(weights, extras={"excess_risk": estimates})
        ratios = torch.tensor(
            [
                estimate / self._baseline(name, estimate)
                for name, estimate in zip(names, estimates, strict=True)
            ],
            dtype=torch.float64,
        )
        # A ratio may overflow (an objective's gradient 1e300 times its baseline): its
        # logit is then the largest float, and a zero weight stays zero.
        logits = torch.log(weights) + self.step_size * ratios
        logits = torch.where(weights > 0, logits, -torch.inf).clamp_max(_LARGEST)
        weights = torch.softmax(logits, dim=0)
        self._lambda.set(names, weights)
        return WeighResult(weights, extras={"excess_risk": estimates, "ratio": ratios.tolist()})

    def _excess_risk(self, name: int, gradient: torch.Tensor) -> float:
        """g^T H^-1 g with H = diag(sqrt(sum of this objective's squared gradients so far))."""
        root = self._roots.get(name)
        if root is None:
            root = torch.zeros_like(gradient)
        elif root.shape != gradient.shape:
            raise ValueError(
                f"objective {name}'s gradient has {gradient.numel()} entries, earlier ones "
                f"{root.numel()}: ExcessMTL keeps per-parameter state (call reset())"
            )
        root = torch.hypot(root, gradient)
        self._roots[name] = root
        size = gradient.abs()
        # |g| <= root entrywise; where root is 0 so is g, and the term is 0.
        share = torch.where(root > 0, size / root, torch.zeros_like(size))
        return float(torch.sum(size * share, dtype=torch.float64))

    def _baseline(self, name: int, estimate: float) -> float:
        """The warm-up average of the objective's estimates, or its first estimate after it."""
        if name not in self._baselines:
            count = self._warmup_counts.get(name, 0)
            self._baselines[name] = self._warmup_sums[name] / count if count else estimate
        return self._baselines[name]
