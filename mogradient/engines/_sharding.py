"""FSDP2 for per-objective gradients: shard the frozen weights, keep the trained ones whole.

Per-objective gradients are ``torch.autograd.grad`` with respect to the trained tensors.
Under FSDP2 (``torch.distributed.fsdp.fully_shard``) a parameter becomes a DTensor shard
while the forward reads an all-gathered copy of it, so autograd never reaches the shard:
its gradient arrives only through FSDP's reduce-scatter into ``.grad``, one backward
(one objective) at a time. Keeping the trained parameters out of the shards
(``ignored_params``) leaves them plain tensors that the forward reads directly: every
engine (K backward passes, the per-row engine, the Gram) works unchanged on each rank,
and the ranks average their local K x D stacks with one all-reduce, as under DDP
([`mogradient.engines.distributed_objective_gradients`][mogradient.engines.distributed_objective_gradients]).

This fits adapter training, where the frozen base is what fills the memory: the LoRA
stays replicated on every rank, and is small beside it (rank 64 on the 20 B Qwen-Image
transformer: 1.7 GB in float32 against 41 GB of bf16 weights).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def shard_frozen(
    module: nn.Module,
    keep: Iterable[torch.Tensor] | None = None,
    blocks: Sequence[nn.Module] | None = None,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard ``module``'s parameters with FSDP2 over the process group, except ``keep``.

    ``keep`` (default: the parameters that require grad) stays whole and replicated: the
    trained parameters, and any the caller updates in place (a second adapter). ``blocks``
    are the units all-gathered one at a time (default: the members of the module's
    top-level ``nn.ModuleList`` s, the transformer blocks of diffusers and transformers
    models), so a forward holds about one block's full weights beside the shards; the
    rest of ``module`` is one more unit. ``mesh`` defaults to a 1-D mesh of all ranks on
    the parameters' device type. Gradient checkpointing that calls the block's
    ``__call__`` (diffusers' and transformers' default) works under it. Returns
    ``module``, sharded in place.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call init_process_group first")
    parameters = list(module.parameters())
    if not parameters:
        raise ValueError("the module has no parameters to shard")
    kept = set(keep) if keep is not None else {p for p in parameters if p.requires_grad}
    if not kept:
        raise ValueError(
            "nothing to keep whole: pass keep= the trained parameters (none requires grad); "
            "a sharded trained parameter has no per-objective gradient"
        )
    if mesh is None:
        mesh = init_device_mesh(parameters[0].device.type, (dist.get_world_size(),))
    units = list(blocks) if blocks is not None else default_blocks(module)
    for unit in units:
        fully_shard(
            unit, mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=kept
        )
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=kept)
    return module


def default_blocks(module: nn.Module) -> list[nn.Module]:
    """The units [`shard_frozen`][mogradient.engines.shard_frozen] all-gathers one at a time unless
    told otherwise: the members of ``module``'s top-level ``nn.ModuleList`` s."""
    return [
        block for child in module.children() if isinstance(child, nn.ModuleList) for block in child
    ]


def is_shard(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (an FSDP2 shard, say), which autograd cannot reach."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)
