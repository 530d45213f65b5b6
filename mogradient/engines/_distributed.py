"""Per-objective gradients across processes: DDP, or FSDP2 with the frozen weights sharded.

Each rank computes its K local gradients (under DDP inside ``no_sync()``, forward
included, so DDP does not wait for a backward that never comes; a module sharded by
[`mogradient.engines.shard_frozen`][mogradient.engines.shard_frozen] keeps its trained parameters
whole, so nothing syncs them), then one all-reduce averages the K x D buffer. Every rank then holds
the same stack, harmonizes it in float64 and writes the same direction into ``.grad``: the
optimizer step is synchronized without a second backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mogradient.combinable import CombinableLoss
from mogradient.engines._rows import RowGradients
from mogradient.engines._stack import combinable_gradients, objective_gradients

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
    sharded by [`shard_frozen`][mogradient.engines.shard_frozen]. With ``rows`` (a
    [`RowGradients`][mogradient.engines.RowGradients] over the unwrapped module) the forward
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
