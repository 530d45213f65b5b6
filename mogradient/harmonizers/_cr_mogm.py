"""CR-MOGM: another harmonizer's weights smoothed by a moving average across steps."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from mogradient._gram import CosineGram
from mogradient.harmonizers._base import Harmonizer, WeighResult, validated_preferences
from mogradient.harmonizers._mgda import MGDA


class CRMOGM(Harmonizer):
    """Correlation-reduced multi-objective gradient manipulation (Zhou, Zhang, Jiang, Zhong,
    Gu and Zhu, On the Convergence of Stochastic Multi-Objective Gradient Manipulation and
    Beyond, NeurIPS 2022).

    Weights computed from the same stochastic gradients they multiply are correlated with
    them, which biases stochastic MGDA-type updates; a moving average of the weights,
    lambda_t = alpha lambda_(t-1) + (1 - alpha) lambda^_t, with lambda^_t the weights of
    ``inner`` (plain MGDA by default), reduces that correlation; the paper's abstract
    describes it as an exponential average of the past weights. ``alpha`` may be changed
    between calls to follow a schedule, e.g. ``1 - lr / initial_lr``, growing towards 1 as
    the learning rate decays.

    lambda is kept per objective in the caller's numbering: an objective seen for the first
    time starts from ``initial_weights[k]`` if given, else from lambda^_t (so the first call
    returns ``inner``'s weights, as TorchJD's ``CRMOGMWeighting`` does). An objective
    dropped for a step keeps its lambda. When ``inner`` recomputes its weights on the stack
    ([`Harmonizer.refine`][mogradient.harmonizers.Harmonizer.refine]), the average uses the
    recomputed ones. Gram-only exactly when ``inner`` is; ``inner``'s state is saved with this
    one's.
    """

    keeps_objective_state: ClassVar[bool] = True

    def __init__(
        self,
        inner: Harmonizer | None = None,
        alpha: float = 0.9,
        initial_weights: list[float] | torch.Tensor | None = None,
    ) -> None:
        self.inner = MGDA(normalize=False) if inner is None else inner
        self.alpha = _checked_alpha(alpha)
        self.initial_weights = validated_preferences(initial_weights, "initial_weights")
        self._lambda: dict[int, float] = {}
        # Between weigh and refine: alpha, the previous lambda and inner's weighting of this call.
        self._pending: tuple[float, torch.Tensor, WeighResult] | None = None

    def reset(self) -> None:
        """Forget the averaged weights and ``inner``'s state (start of a new run)."""
        super().reset()
        self._lambda.clear()
        self.inner.reset()

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "lambda": dict(self._lambda),
            "alpha": self.alpha,
            "inner": self.inner.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._lambda = dict(state.get("lambda", {}))
        self.alpha = _checked_alpha(state.get("alpha", self.alpha))
        self.inner.load_state_dict(state.get("inner", {}))

    def weigh(self, gram: CosineGram, objectives: torch.Tensor) -> WeighResult:
        alpha = _checked_alpha(self.alpha)
        inner = self.inner.weigh(gram, objectives)
        names = [int(index) for index in objectives]
        previous = torch.tensor(
            [
                self._lambda.get(name, self._start(name, float(value)))
                for name, value in zip(names, inner.weights.tolist(), strict=True)
            ],
            dtype=torch.float64,
        )
        self._pending = (alpha, previous, inner)
        return self._smoothed(names, alpha, previous, inner)

    def refine(
        self,
        jacobian: torch.Tensor,
        objectives: torch.Tensor,
        gram: CosineGram,
        weighting: WeighResult,
    ) -> WeighResult | None:
        if self._pending is None:
            return None
        alpha, previous, inner = self._pending
        refined = self.inner.refine(jacobian, objectives, gram, inner)
        if refined is None:
            return None
        return self._smoothed([int(index) for index in objectives], alpha, previous, refined)

    def _start(self, name: int, inner_weight: float) -> float:
        if self.initial_weights is None:
            return inner_weight
        if name >= len(self.initial_weights):
            raise ValueError(
                f"got objective index {name} but only {len(self.initial_weights)} "
                "initial weights; give one per objective"
            )
        return float(self.initial_weights[name])

    def _smoothed(
        self, names: list[int], alpha: float, previous: torch.Tensor, inner: WeighResult
    ) -> WeighResult:
        weights = alpha * previous + (1.0 - alpha) * inner.weights.to(torch.float64)
        self._lambda.update(zip(names, weights.tolist(), strict=True))
        extras = {
            **inner.extras,
            "inner_weights": inner.weights.tolist(),
            "inner_kkt_residual": inner.kkt_residual,
        }
        return WeighResult(weights, fallback=inner.fallback, extras=extras)


def _checked_alpha(alpha: float) -> float:
    if not (math.isfinite(alpha) and 0.0 <= alpha <= 1.0):
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    return float(alpha)
