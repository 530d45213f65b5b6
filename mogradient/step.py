"""One multi-objective optimizer step, as a training loop takes it.

Every loop that harmonizes gradients needs the same five parts: the per-objective
gradients by the cheapest exact engine (checked once against K backward passes), their
mean over ranks, weights from an amortized harmonizer (a fresh solve on the stack, or the
cached weights and one combined backward), the weighted sum written into ``.grad``, and a
record of what happened. [`HarmonizedStep`][mogradient.step.HarmonizedStep] owns them; clipping, the
optimizer and logging stay with the caller. [`apply_weights`][mogradient.step.apply_weights] and
[`apply_harmonized`][mogradient.step.apply_harmonized] are the apply part on its own, for loops that
build their stack themselves.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from mogradient.amortize import AmortizedStep, Amortizer
from mogradient.combinable import CombinableLoss
from mogradient.diagnostics import conflict_diagnostics
from mogradient.engines import (
    GradientEngine,
    LossStream,
    RowGradientError,
    accumulate_gradients,
    flat_gradient,
    gram_factor,
    output_cosines,
    output_gram,
    write_gradient,
)
from mogradient.harmonizers._base import Harmonization, Harmonizer, combine

# (stack or None, number of objectives) -> the weights to apply: a fresh solve on the
# stack, or (None) the cached or fixed weights of a step without per-objective gradients.
Weigh = Callable[[torch.Tensor | None, int], AmortizedStep]


class Collective(Protocol):
    """The cross-rank operations a step needs; on one process each is the identity."""

    def average(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def average_gradients(self, parameters: list[torch.Tensor]) -> None: ...

    def broadcast(self, tensor: torch.Tensor, source: int = 0) -> torch.Tensor: ...


class DefaultGroup:
    """[`Collective`][mogradient.step.Collective] over torch.distributed's default group (when
    initialized)."""

    def average(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place mean over ranks (returns the tensor)."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
            tensor /= dist.get_world_size()
        return tensor

    def average_gradients(self, parameters: list[torch.Tensor]) -> None:
        """Mean of ``.grad`` over ranks with one flat all-reduce."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            write_gradient(parameters, self.average(flat_gradient(parameters)))

    def broadcast(self, tensor: torch.Tensor, source: int = 0) -> torch.Tensor:
        """Rank ``source``'s value on every rank (a copy)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return tensor
        device = tensor.device
        if dist.get_backend() == "nccl":  # NCCL moves CUDA tensors only
            device = torch.device("cuda", torch.cuda.current_device())
        copy = tensor.to(device).clone()
        dist.broadcast(copy, src=source)
        return copy.to(tensor.device)


def every_step(harmonizer: Harmonizer) -> Weigh:
    """The `Weigh` of a bare harmonizer: a fresh solve on every step, no cache."""

    def weigh(jacobian: torch.Tensor | None, count: int) -> AmortizedStep:
        if jacobian is None:
            raise ValueError(
                "a bare harmonizer keeps no weights between steps: call solve(), or wrap it "
                "in an Amortizer to reuse its weights on combined steps"
            )
        harmonization = harmonizer(jacobian)
        return AmortizedStep(harmonization.weights, True, harmonization, harmonization.fallback)

    return weigh


def amortized(amortizer: Amortizer) -> Weigh:
    """The `Weigh` of an [`Amortizer`][mogradient.amortize.Amortizer]: solve on a stack, else
    cache."""

    def weigh(jacobian: torch.Tensor | None, count: int) -> AmortizedStep:
        return amortizer.cached_step() if jacobian is None else amortizer.full_step(jacobian)

    return weigh


@dataclass
class StepReport:
    """What one step applied and how: the caller logs it under its own names."""

    weights: torch.Tensor  # on the raw per-objective gradients
    solved: bool  # per-objective gradients and a fresh solve (else cached weights)
    fallback: str | None
    engine: str | None  # the gradient engine of a solve step ("rows" or "batched")
    backward_seconds: float
    harmonize_seconds: float  # rank averaging, the solve, writing .grad, diagnostics
    # a solve step's conflict diagnostics of the applied update (conflict_diagnostics'
    # scalar entries: cos_min, cos_mean, norm/k, weight/k, stationary, ...)
    diagnostics: dict[str, Any] = field(default_factory=dict)


class HarmonizedStep:
    """Per-objective gradients, rank mean, weights, ``.grad`` and a report, for one step.

    ``weigh`` is an [`Amortizer`][mogradient.amortize.Amortizer] (fresh solves on
    [`solve`][mogradient.step.HarmonizedStep.solve] steps, its cache on
    [`combine`][mogradient.step.HarmonizedStep.combine] steps), a bare
    [`Harmonizer`][mogradient.harmonizers.Harmonizer] (a solve on every step), or any `Weigh`
    function.

    ``losses`` are streams of ``(scale, CombinableLoss)`` pieces (gradient accumulation
    over micro-batches; [`separate`][mogradient.combinable.CombinableLoss.separate] makes one of K
    plain losses). ``replay()`` gives the same stream again (same draws): the per-row engine is
    checked once against K backward passes on it, and a model the engine refuses is
    replayed with K backward passes; either way the run goes on with that engine, and
    ``warn`` says why. ``module`` holds the parameters (for the per-row engine; None
    uses K backward passes). Terms outside the harmonization (``extra``) go to ``.grad``.
    """

    def __init__(
        self,
        parameters: Sequence[torch.Tensor],
        weigh: Weigh | Amortizer | Harmonizer,
        *,
        module: nn.Module | None = None,
        engine: str = "auto",
        compute_dtype: torch.dtype = torch.float32,
        collective: Collective | None = None,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self.parameters = list(parameters)
        # a harmonizer whose direction is not a weighted sum (TrimmedMean, GradDrop) has
        # its own direction applied, which no cached weights can reproduce
        self.coordinatewise = isinstance(weigh, Harmonizer) and not weigh.direction_is_weighted_sum
        self.amortizer = weigh if isinstance(weigh, Amortizer) else None
        if isinstance(weigh, Amortizer):
            weigh = amortized(weigh)
        elif isinstance(weigh, Harmonizer):
            weigh = every_step(weigh)
        self.weigh: Weigh = weigh
        self.engine = GradientEngine(
            module, self.parameters, engine if module is not None else "batched", compute_dtype
        )
        self.collective = collective if collective is not None else DefaultGroup()
        self.warn = warn if warn is not None else _warn

    def backward(
        self,
        losses: LossStream | torch.Tensor,
        count: int | None = None,
        replay: Callable[[], LossStream] | None = None,
    ) -> StepReport:
        """[`solve`][mogradient.step.HarmonizedStep.solve] or, where the Amortizer schedules a
        cached step, [`combine`][mogradient.step.HarmonizedStep.combine]."""
        if self.amortizer is not None and not self.amortizer.needs_full_solve():
            return self.combine(losses, count)
        return self.solve(losses, count, replay)

    def solve(
        self,
        losses: LossStream | torch.Tensor,
        count: int | None = None,
        replay: Callable[[], LossStream] | None = None,
        *,
        pieces: int | None = None,
    ) -> StepReport:
        """The K gradients, their rank mean, a fresh solve, ``sum_k w_k g_k`` into ``.grad``.

        ``losses``: a stream of pieces with its ``count`` (K), or a tensor of K losses.
        ``pieces``: solve on the stream's first ``pieces`` pieces only (the K gradients of
        those), and apply the solved weights to the whole stream, the rest by one combined
        backward per piece: a cheaper solve that sees less of the step."""
        losses, count = _as_stream(losses, count)
        if pieces is not None and (pieces < 1 or self.coordinatewise):
            raise ValueError(
                "pieces must be >= 1, and a solve on part of the step needs weights to "
                "apply to the rest (not a coordinate-wise harmonizer)"
            )
        stream = iter(losses)
        solving, solving_replay = stream, replay
        if pieces is not None:
            solving = itertools.islice(stream, pieces)
            if replay is not None:
                solving_replay = _first_pieces(replay, pieces)
        started = time.perf_counter()
        stack = self.gradients(solving, count, solving_replay)
        backward = time.perf_counter() - started
        started = time.perf_counter()
        stack = self.collective.average(stack)
        solved = self.weigh(stack, count)
        backward_rest = 0.0
        if pieces is not None:  # the rest of the step, with the weights just solved
            rest = time.perf_counter()
            weights = self.collective.broadcast(solved.weights)
            accumulate_gradients(stream, self.parameters, weights)
            backward_rest = time.perf_counter() - rest
        self.collective.average_gradients(self.parameters)
        if self.coordinatewise:
            direction = self.collective.broadcast(solved.harmonization.direction)
            write_gradient(self.parameters, direction, accumulate=True)
            weights = solved.weights
        else:
            weights, direction = self.apply(stack, solved.weights)
        return StepReport(
            weights,
            True,
            solved.fallback,
            self.engine.name,
            backward + backward_rest,
            time.perf_counter() - started - backward_rest,
            _diagnostics(weights, stack, direction, solved),
        )

    def solve_outputs(
        self, losses: LossStream, count: int, *, pieces: int | None = None
    ) -> StepReport:
        """A fresh solve on the gradients with respect to the network's output (each
        piece's ``CombinableLoss.outputs``): no backward through the network for them.

        The first ``pieces`` pieces (None: all) are forwarded and held; the Gram of their
        output gradients (the ranks' mean: the norms' ratios and the angles of their sum) is
        solved, and one combined backward per
        piece applies the weights to the whole stream. Holding the pieces' graphs costs
        their activations' memory. MGDA-UB's approximation: the weights are optimal in
        output space; the harmonizer sees a K x K factor of that Gram, so it must read
        only norms and angles (MGDA does)."""
        if self.coordinatewise:
            raise ValueError(
                "an output-space solve gives weights: not a coordinate-wise harmonizer"
            )
        stream = iter(losses)
        started = time.perf_counter()
        held = list(stream if pieces is None else itertools.islice(stream, pieces))
        # the ranks' mean Gram: norms and angles (all the weights read) as of the sum
        gram = self.collective.average(output_gram(held, count))
        solving = time.perf_counter() - started
        solved = self.weigh(gram_factor(gram), count)
        weights = self.collective.broadcast(solved.weights)
        started = time.perf_counter()
        accumulate_gradients(held, self.parameters, weights)
        del held
        accumulate_gradients(stream, self.parameters, weights)
        backward = time.perf_counter() - started
        started = time.perf_counter()
        self.collective.average_gradients(self.parameters)
        diagnostics = _output_diagnostics(gram, weights)
        return StepReport(
            weights,
            True,
            solved.fallback,
            "outputs",
            backward,
            solving + time.perf_counter() - started,
            diagnostics,
        )

    def combine(
        self,
        losses: LossStream | torch.Tensor,
        count: int | None = None,
        *,
        measure_outputs: bool = False,
    ) -> StepReport:
        """Rank 0's cached (or fixed) weights and one combined backward per piece.

        ``measure_outputs``: also the cached weights' worst cosine with a reward in output
        space (``diagnostics["output_cos_min"]``), from the pieces' output gradients: a
        cheap sign that the cache went stale."""
        losses, count = _as_stream(losses, count)
        cached = self.weigh(None, count)
        weights = self.collective.broadcast(cached.weights)
        started = time.perf_counter()
        diagnostics = {}
        if measure_outputs:
            gram = torch.zeros(count, count, dtype=torch.float64)
            for scale, loss in losses:
                gram += output_gram([(scale, loss)], count)
                accumulate_gradients([(scale, loss)], self.parameters, weights)
            diagnostics = _output_diagnostics(self.collective.average(gram), weights)
        else:
            accumulate_gradients(losses, self.parameters, weights)
        backward = time.perf_counter() - started
        started = time.perf_counter()
        self.collective.average_gradients(self.parameters)
        harmonize = time.perf_counter() - started
        return StepReport(weights, False, cached.fallback, None, backward, harmonize, diagnostics)

    def gradients(
        self, losses: LossStream, count: int, replay: Callable[[], LossStream] | None = None
    ) -> torch.Tensor:
        """This rank's K x D stack of ``losses`` (``extra`` to ``.grad``), by the engine,
        checked the first time; a refusing or disagreeing per-row engine is replaced by
        K backward passes on ``replay()``, for good (needed only with the per-row engine)."""
        if replay is None and self.engine.rows is not None:
            raise ValueError(
                "the per-row engine is checked against K backward passes on a replay of the "
                "step, and a model it refuses is replayed: pass replay (a function giving the "
                "same loss stream again), or engine='batched'"
            )
        try:
            stack = self.engine.stack(losses, count)
        except RowGradientError as error:
            self._use_k_backward(f"refused this model ({error})")
            for parameter in self.parameters:  # a refused pass may have begun .grad
                parameter.grad = None
            return self.engine.stack(replay(), count)
        if not self.engine.checked:
            reason, reference = self.engine.check(stack, replay, count)
            failed = torch.tensor([0.0 if reason is None else 1.0], device=stack.device)
            if float(self.collective.average(failed)) > 0:  # every rank agrees
                self._use_k_backward(
                    "disagreed with K backward passes on this model "
                    f"({reason or 'on another rank'})"
                )
                stack.copy_(reference)
        return stack

    def apply(
        self, stack: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add rank 0's ``sum_k w_k g_k`` of a rank-averaged stack to ``.grad``;
        (weights, direction)."""
        weights = self.collective.broadcast(weights)
        direction = combine(stack, weights)
        write_gradient(self.parameters, direction, accumulate=True)
        return weights, direction

    def _use_k_backward(self, why: str) -> None:
        engine = self.engine.name
        self.engine.use_k_backward()
        self.warn(
            f"the {engine} gradient engine {why}; training goes on with the K-backward "
            "engine (train.gradient_engine=batched)"
        )


def apply_weights(
    parameters: Sequence[torch.Tensor],
    jacobian: torch.Tensor,
    weights: torch.Tensor,
    broadcast_from: int | None = 0,
    accumulate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write ``sum_k w_k g_k`` of a rank-averaged stack into ``.grad``; (weights, direction).

    The weights are rank ``broadcast_from``'s (default 0), which makes identical updates
    on every rank a guarantee rather than an assumption about bitwise-reproducible
    collectives. ``accumulate`` adds to ``.grad`` (e.g. a KL term already there).
    """
    if broadcast_from is not None and dist.is_initialized():
        weights = weights.to(jacobian.device).clone()
        dist.broadcast(weights, src=broadcast_from)
        weights = weights.cpu()
    direction = combine(jacobian, weights)
    write_gradient(parameters, direction, accumulate=accumulate)
    return weights, direction


def apply_harmonized(
    parameters: Sequence[torch.Tensor],
    jacobian: torch.Tensor,
    harmonizer: Harmonizer,
    broadcast_from: int | None = 0,
    accumulate: bool = False,
) -> Harmonization:
    """Harmonize a rank-averaged stack and write the direction into ``.grad``.

    The stack is identical on all ranks, so the float64 solve is too; the weights are
    then broadcast and applied as in [`apply_weights`][mogradient.step.apply_weights]. A method
    whose direction is not a weighted sum (TrimmedMean, GradDrop) has rank ``broadcast_from``'s
    direction broadcast and written instead.
    """
    harmonization = harmonizer(jacobian)
    if not harmonizer.direction_is_weighted_sum:
        direction = harmonization.direction
        if broadcast_from is not None and dist.is_initialized():
            direction = direction.clone()
            dist.broadcast(direction, src=broadcast_from)
        write_gradient(parameters, direction, accumulate=accumulate)
        return dataclasses.replace(harmonization, direction=direction)
    weights, direction = apply_weights(
        parameters, jacobian, harmonization.weights, broadcast_from, accumulate
    )
    return dataclasses.replace(harmonization, weights=weights, direction=direction)


def _first_pieces(replay: Callable[[], LossStream], pieces: int) -> Callable[[], LossStream]:
    """A replay of the first ``pieces`` pieces only."""
    return lambda: itertools.islice(replay(), pieces)


def _diagnostics(
    weights: torch.Tensor, stack: torch.Tensor, direction: torch.Tensor, solved: AmortizedStep
) -> dict[str, Any]:
    """The scalar conflict diagnostics of a solve's applied direction against its stack."""
    harmonization = solved.harmonization
    diagnostics = conflict_diagnostics(
        weights,
        jacobian=stack,
        direction=direction,
        dropped=harmonization.dropped if harmonization else (),
        fallback=solved.fallback,
    )
    return {k: v for k, v in diagnostics.items() if not isinstance(v, list)}


def _output_diagnostics(gram: torch.Tensor, weights: torch.Tensor) -> dict[str, Any]:
    """The applied weights' worst cosine with an objective in output space (an objective
    with a zero output gradient cannot conflict)."""
    cosines = output_cosines(gram, weights)
    return {"output_cos_min": float(cosines.nan_to_num(nan=1.0).min())}


def _as_stream(losses: LossStream | torch.Tensor, count: int | None) -> tuple[LossStream, int]:
    """A tensor of K losses as a one-piece stream; a stream as it is, with its count."""
    if isinstance(losses, torch.Tensor):
        return [(1.0, CombinableLoss.separate(losses))], len(losses)
    if count is None:  # not read off the first piece: drawing it runs its forward here
        raise ValueError("a stream of (scale, CombinableLoss) pieces needs count (K objectives)")
    return losses, count


def _warn(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)
