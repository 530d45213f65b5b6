"""What the gradient-aware scalarizations share: checked shared parameters, their K task
gradients, and a loss whose backward sends a chosen direction to them."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from mogradient.engines._stack import objective_gradients


def shared_parameters(method: str, shared: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The shared parameters a gradient-aware scalarization differentiates, checked."""
    tensors = list(shared)
    if not tensors:
        raise ValueError(
            f"{method}: shared is empty; pass the shared parameters the task gradients are "
            "taken on, e.g. list(model.trunk.parameters())"
        )
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"{method}: shared[{index}] is a {type(tensor).__name__}, not a tensor; pass "
                "parameters such as model.trunk.parameters() (not named_parameters())"
            )
        if not tensor.requires_grad:
            raise ValueError(
                f"{method}: shared[{index}] (shape {tuple(tensor.shape)}) does not require "
                "grad; pass only the trainable shared parameters"
            )
    return tensors


def shared_gradients(method: str, losses: torch.Tensor, shared: list[torch.Tensor]) -> torch.Tensor:
    """K x D gradients of the losses on the shared parameters, the graph kept for backward."""
    if not losses.requires_grad:
        raise ValueError(
            f"{method} differentiates the losses but they carry no graph; call it on the "
            "training losses, outside torch.no_grad()"
        )
    return objective_gradients(losses, shared, retain_graph=True)


def redirect_shared(
    loss: torch.Tensor, shared: list[torch.Tensor], correction: torch.Tensor
) -> torch.Tensor:
    """``loss`` with the same value, whose backward adds ``correction`` to the shared gradient.

    Returns loss + <c, theta> - <c, theta>.detach() for the flat, detached c: the added
    term is exactly zero, and its gradient is c on the shared parameters, nothing elsewhere.
    """
    pieces = torch.split(correction.detach(), [parameter.numel() for parameter in shared])
    term = sum(
        (piece.view_as(parameter).to(parameter.dtype) * parameter).sum()
        for piece, parameter in zip(pieces, shared, strict=True)
    )
    return loss + (term - term.detach())
