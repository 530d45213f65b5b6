"""Per-objective gradients across processes: DDP, or FSDP2 with the frozen weights sharded.

Each rank computes its K local gradients (under DDP inside ``no_sync()``, forward
included, so DDP does not wait for a backward that never comes; a module sharded by
:func:`mogradient.sharding.shard_frozen` keeps its trained parameters whole, so nothing
syncs them), then one all-reduce averages the K x D buffer. Every rank then holds the
same stack, harmonizes it in float64 and writes the same direction into ``.grad``: the
optimizer step is synchronized without a second backward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mogradient.combinable import CombinableLoss
from mogradient.gradients import combinable_gradients, objective_gradients, write_gradient
from mogradient.harmonizers.base import Harmonization, Harmonizer, combine
from mogradient.row_gradients import RowGradients

LossFunction = Callable[[], "torch.Tensor | Sequence[torch.Tensor] | CombinableLoss"]


def distributed_objective_gradients(
    model: nn.Module,
    compute_losses: LossFunction,
    parameters: Sequence[torch.Tensor],
    method: str = "sequential",
    rows: RowGradients | None = None,
) -> torch.Tensor:
    """Rank-averaged K x D gradients of the losses ``compute_losses`` computes on this rank.

    ``model`` is a DDP wrapper (the forward then runs under ``no_sync``) or a module
    sharded by :func:`~mogradient.sharding.shard_frozen`. With ``rows`` (a
    :class:`~mogradient.row_gradients.RowGradients` over the unwrapped module) the forward
    is recorded and a CombinableLoss that declares its rows gets its local stack from one
    backward pass per row value; the all-reduce is the same.
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call init_process_group first")
    unsynced = model.no_sync() if isinstance(model, DistributedDataParallel) else nullcontext()
    with unsynced:
        if rows is None:
            losses = compute_losses()
        else:
            with rows.recording():
                losses = compute_losses()
        if rows is not None and isinstance(losses, CombinableLoss) and rows.supports(losses):
            stack = rows.stack(losses)
        elif isinstance(losses, CombinableLoss):
            stack = combinable_gradients(losses, parameters, method=method)
        else:
            stack = objective_gradients(losses, parameters, method=method)
    dist.all_reduce(stack, op=dist.ReduceOp.SUM)
    stack /= dist.get_world_size()
    return stack


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
    then broadcast and applied as in :func:`apply_weights`. A method whose direction is
    not a weighted sum (TrimmedMean, GradDrop) has rank ``broadcast_from``'s direction
    broadcast and written instead.
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
