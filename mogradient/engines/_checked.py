"""Which engine computes an optimizer step's per-objective gradients, and its check.

``train.gradient_engine: auto`` uses
[`mogradient.engines.RowGradients`][mogradient.engines.RowGradients] (one backward pass per row
value of the objective's losses) when every trained parameter sits in an ``nn.Linear`` (peft's LoRA
layers do), and checks it once per process against the K-backward engine on a replay of the first
solve step: a model that breaks its assumptions (rows mixed in the forward, a weight used outside
its module) is then trained with the K-backward engine, with a warning, never with wrong
gradients. ``batched`` forces the K-backward engine (one vmapped backward with K
cotangents), for comparison.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from mogradient.combinable import CombinableLoss
from mogradient.engines._rows import RowGradientError, RowGradients, check_close
from mogradient.engines._stack import accumulate_gradients

ENGINES = ("auto", "batched")
LossStream = Iterable[tuple[float, CombinableLoss]]


class GradientEngine:
    """The K x D stack of a step's loss stream by the configured engine."""

    def __init__(
        self,
        module: nn.Module,
        parameters: list[torch.Tensor],
        engine: str,
        compute_dtype: torch.dtype,
    ) -> None:
        if engine not in ENGINES:
            raise ValueError(f"unknown gradient engine {engine!r}; choose one of {ENGINES}")
        self.parameters = parameters
        self.compute_dtype = compute_dtype
        rows = RowGradients(module, parameters) if engine == "auto" else None
        self.rows = rows if rows is not None and rows.supported else None
        self.checked = self.rows is None

    @property
    def name(self) -> str:
        return "batched" if self.rows is None else "rows"

    def stack(self, losses: LossStream, count: int, apply_extra: bool = True) -> torch.Tensor:
        """``sum scale * grad L_k`` over the pieces; ``extra`` to ``.grad`` if asked."""
        if self.rows is None:
            return accumulate_gradients(
                losses, self.parameters, count=count, apply_extra=apply_extra
            )
        return self.rows.accumulate(losses, count=count, apply_extra=apply_extra)

    def check(
        self, stack: torch.Tensor, replay: Callable[[], LossStream], count: int
    ) -> tuple[str | None, torch.Tensor]:
        """Compare ``stack`` with the K-backward engine on ``replay()``, the same step.

        Returns the reason they disagree (None when they agree) and the K-backward stack.
        Call it once, with this rank's stack, before averaging over ranks; after it the
        engine counts as checked (``use_k_backward`` switches it off for good).
        """
        self.checked = True
        reference = accumulate_gradients(replay(), self.parameters, count=count, apply_extra=False)
        reference = reference.to(stack.dtype)
        try:
            check_close(stack, reference, self.compute_dtype)
        except RowGradientError as error:
            return str(error), reference
        return None, reference

    def use_k_backward(self) -> None:
        """Give up the per-row engine for the rest of the run."""
        self.rows = None
