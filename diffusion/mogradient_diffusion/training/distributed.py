"""Process-group plumbing for ``torchrun``: one object the trainer asks for ranks and collectives.

Without ``torchrun`` (no ``WORLD_SIZE`` in the environment) every collective is the
identity, so the same loop runs on one CPU or GPU. torchrun's variables left behind in a
shell with values no torchrun would set are refused in one line, before any work.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mogradient.engines import flat_gradient, write_gradient
from mogradient_diffusion.config.settings import ConfigError

# What init_process_group reads besides WORLD_SIZE: torchrun sets them all.
RENDEZVOUS_VARIABLES = ("RANK", "MASTER_ADDR", "MASTER_PORT")
_FIX = "torchrun sets it: unset it to train in one process, or start the run with torchrun"


@dataclass
class World:
    rank: int
    size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @staticmethod
    def size_from_environment() -> int:
        """The world size torchrun announced (1 without torchrun), known before any setup;
        checks the other variables too, so that a bad one stops the run here."""
        return _environment()[0]

    @classmethod
    def from_environment(cls, device: str = "auto") -> World:
        """Join the torchrun process group if there is one (gloo on CPU, NCCL on CUDA)."""
        size, local_rank = _environment()
        if device == "auto":
            device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
        resolved = torch.device(device)
        if resolved.type == "cuda" and resolved.index is None:  # set_device needs an index
            resolved = torch.device("cuda", local_rank)
        if resolved.type == "cuda":
            torch.cuda.set_device(resolved)
        if size > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if resolved.type == "cuda" else "gloo")
        rank = dist.get_rank() if size > 1 else 0
        return cls(rank=rank, size=size, device=resolved)

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    def average(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place mean over ranks (returns the tensor)."""
        if self.size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
            tensor /= self.size
        return tensor

    def average_gradients(self, parameters: list[torch.Tensor]) -> None:
        """Mean of ``.grad`` over ranks with one flat all-reduce (missing grads count as 0)."""
        if self.size == 1:
            return
        write_gradient(parameters, self.average(flat_gradient(parameters)))

    def broadcast(self, tensor: torch.Tensor, source: int = 0) -> torch.Tensor:
        """Rank ``source``'s value on every rank (a copy on the tensor's device)."""
        if self.size == 1:
            return tensor
        moved = tensor.to(self.device).clone()
        dist.broadcast(moved, src=source)
        return moved.to(tensor.device)

    def all_gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's rows in rank order (equal row counts on all ranks)."""
        if self.size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts)

    def broadcast_parameters(self, parameters: list[torch.Tensor]) -> None:
        """Copy rank 0's values into every replica, as DDP does when it wraps a model."""
        if self.size == 1:
            return
        for parameter in parameters:
            data = parameter.detach().to(self.device).clone()
            dist.broadcast(data, src=0)
            parameter.data.copy_(data.to(parameter.device))

    def divergence(self, parameters: list[torch.Tensor]) -> float:
        """Largest |p - p_rank0| over all ranks: 0.0 when the replicas are in sync."""
        if self.size == 1:
            return 0.0
        flat = torch.cat([p.detach().reshape(-1) for p in parameters]).to(self.device)
        reference = flat.clone()
        dist.broadcast(reference, src=0)
        gap = (flat - reference).abs().max()
        dist.all_reduce(gap, op=dist.ReduceOp.MAX)
        return float(gap)

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _environment() -> tuple[int, int]:
    """(WORLD_SIZE, LOCAL_RANK) as torchrun sets them; a ConfigError naming the variable
    for values it never sets (a rank is below the world size, which counts processes)."""
    size = _variable("WORLD_SIZE", default=1, minimum=1)
    local_rank = _variable("LOCAL_RANK", default=0, minimum=0)
    rank = _variable("RANK", default=0, minimum=0)
    if "WORLD_SIZE" in os.environ:
        for name, value in (("RANK", rank), ("LOCAL_RANK", local_rank)):
            if value >= size:
                raise ConfigError(
                    f"{name}={value} in the environment is not below WORLD_SIZE={size}; {_FIX}"
                )
    missing = [name for name in RENDEZVOUS_VARIABLES if name not in os.environ]
    if size > 1 and missing:
        raise ConfigError(
            f"WORLD_SIZE={size} is in the environment but {', '.join(missing)} not; {_FIX}"
        )
    return size, local_rank


def _variable(name: str, default: int, minimum: int) -> int:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} in the environment is not an integer; {_FIX}") from None
    if value < minimum:
        raise ConfigError(f"{name}={value} in the environment must be >= {minimum}; {_FIX}")
    return value
