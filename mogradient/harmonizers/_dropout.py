"""Reward dropout: a random subset of objectives sits out each step."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from mogradient._gram import CosineGram
from mogradient.harmonizers._base import Harmonizer, WeighResult, seeded_generator


class RewardDropout(Harmonizer):
    """Drop each listed objective with probability p per step, then apply ``inner`` to the rest.

    ``droppable`` lists the objectives that may be dropped (default: all). p ramps
    linearly from 0 over ``warmup_steps`` calls. If every usable objective would be
    dropped, one of them, chosen uniformly, is kept so a step is never empty. The
    inner harmonizer sees only the kept objectives
    ([`FixedWeights`][mogradient.harmonizers.FixedWeights] rescales them to its configured total).
    Inside an [`Amortizer`][mogradient.amortize.Amortizer] a mask lasts as long as the cached
    weights: use ``period=1`` for a fresh mask per step (cheap: the wrapped weighting needs no
    gradients).
    """

    randomized: ClassVar[bool] = True

    def __init__(
        self,
        inner: Harmonizer,
        probability: float,
        droppable: list[int] | None = None,
        warmup_steps: int = 0,
        seed: int | None = None,
    ) -> None:
        if not 0.0 <= probability <= 1.0:
            raise ValueError(f"dropout probability must be in [0, 1], got {probability}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.inner = inner
        self.probability = float(probability)
        self.droppable = None if droppable is None else sorted(set(droppable))
        self.warmup_steps = int(warmup_steps)
        self.seed = seed
        self.step = 0
        self._generator = seeded_generator(seed)

    @property
    def keeps_objective_state(self) -> bool:  # type: ignore[override]
        """Whether ``inner`` keeps per-objective state: then every call must have the same K."""
        return self.inner.keeps_objective_state

    def reset(self) -> None:
        """Forget the state (start of a new run): the warm-up restarts, ``inner`` is reset."""
        super().reset()
        self.step = 0
        self.inner.reset()

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "step": self.step, "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.step = int(state["step"])
        self.inner.load_state_dict(state["inner"])

    def current_probability(self) -> float:
        """The dropout probability in effect for the next call (after warm-up: ``probability``)."""
        if self.warmup_steps == 0:
            return self.probability
        return self.probability * min(1.0, self.step / self.warmup_steps)

    def weigh(self, gram: CosineGram, objectives: torch.Tensor) -> WeighResult:
        probability = self.current_probability()
        self.step += 1
        droppable = torch.tensor(
            [self.droppable is None or int(index) in self.droppable for index in objectives]
        )
        draws = torch.rand(len(objectives), generator=self._generator, dtype=torch.float64)
        keep = ~(droppable & (draws < probability))
        if not keep.any():
            keep[int(torch.randint(len(objectives), (1,), generator=self._generator))] = True
        kept = torch.nonzero(keep).flatten()
        inner = self.inner.weigh(gram.subset(kept), objectives[kept])
        weights = torch.zeros(len(objectives), dtype=torch.float64)
        weights[kept] = inner.weights
        dropped = [int(index) for index in objectives[~keep]]
        extras = {**inner.extras, "dropped": dropped, "dropout_probability": probability}
        return WeighResult(weights, inner.kkt_residual, inner.fallback, extras)
