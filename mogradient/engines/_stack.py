"""Per-objective gradient engines: the K x D stack of gradients of K losses.

Two local engines: ``sequential`` (K backward passes, lowest peak memory) and
``batched`` (one vmapped backward with K cotangents, optionally in chunks). The DDP
engine lives in `mogradient.engines._distributed`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from mogradient._finite import all_finite
from mogradient.combinable import CombinableLoss
from mogradient.engines._sharding import is_shard
from mogradient.errors import UnusedParameterError

ParameterFilter = Callable[[str, nn.Parameter], bool]
# Plain tensors, or named ones (``module.named_parameters()`` or a dict) so that errors
# can name the parameter.
Parameters = (
    Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
)


def select_parameters(module: nn.Module, keep: ParameterFilter | None = None) -> list[nn.Parameter]:
    """Trainable parameters of ``module`` that pass ``keep(name, parameter)`` (e.g. LoRA only)."""
    selected = [
        parameter
        for name, parameter in module.named_parameters()
        if parameter.requires_grad and (keep is None or keep(name, parameter))
    ]
    if not selected:
        raise ValueError(
            f"no trainable parameters selected in {type(module).__name__}: check that "
            "requires_grad is set and that the parameter filter matches some names"
        )
    return selected


def objective_gradients(
    losses: torch.Tensor | Sequence[torch.Tensor],
    parameters: Parameters,
    method: str = "sequential",
    chunk_size: int | None = None,
    retain_graph: bool = False,
) -> torch.Tensor:
    """Return the K x D stack of flattened gradients of each loss w.r.t. ``parameters``.

    A parameter that one loss does not depend on but another does contributes zeros to
    the first one's row. A parameter that no loss depends on raises
    [`UnusedParameterError`][mogradient.errors.UnusedParameterError]. ``retain_graph`` keeps the
    graph alive after the last pass (for a later combined backward). ``parameters`` may be
    named (``module.named_parameters()``), so that the error names them.
    """
    parameters, names = _checked_parameters(parameters)
    losses = _stacked_losses(losses)
    if method == "sequential":
        return _sequential(losses, parameters, names, retain_graph)
    if method == "batched":
        return _batched_vjp(
            losses,
            torch.eye(len(losses), dtype=losses.dtype, device=losses.device),
            parameters,
            names,
            chunk_size,
            retain_graph,
        )
    raise ValueError(f"unknown gradient method {method!r}; use 'sequential' or 'batched'")


def combinable_gradients(
    loss: CombinableLoss,
    parameters: Parameters,
    method: str = "batched",
    chunk_size: int | None = None,
    retain_graph: bool = False,
) -> torch.Tensor:
    """K x D gradients of a [`CombinableLoss`][mogradient.combinable.CombinableLoss]'s objectives
    (``extra`` excluded).

    ``batched`` back-propagates the shared terms once per chunk of objectives with the
    coefficients as cotangents, so the forward graph is walked K/chunk times in one
    vmapped pass instead of K separate ones. Unused parameters are handled as in
    [`objective_gradients`][mogradient.engines.objective_gradients].
    """
    parameters, names = _checked_parameters(parameters)
    if method == "sequential":
        return _sequential(loss.objective_losses(), parameters, names, retain_graph)
    if method != "batched":
        raise ValueError(f"unknown gradient method {method!r}; use 'sequential' or 'batched'")
    terms = loss.terms.reshape(-1)
    cotangents = loss.coefficients.to(device=terms.device, dtype=terms.dtype)
    cotangents = cotangents.reshape(loss.num_objectives, -1)
    return _batched_vjp(terms, cotangents, parameters, names, chunk_size, retain_graph)


def write_gradient(
    parameters: Iterable[torch.Tensor], direction: torch.Tensor, accumulate: bool = False
) -> None:
    """Store a flat direction into ``.grad`` of each parameter.

    Replaces what was there, or with ``accumulate`` adds to it (a missing ``.grad``
    counts as zeros), e.g. on top of a non-harmonized term already back-propagated.
    A direction holding NaN or Inf raises ``ValueError`` and nothing is written: one
    step on it would spoil the parameters for good (one sum, one device sync).
    """
    parameters = list(parameters)
    total = sum(parameter.numel() for parameter in parameters)
    if direction.shape != (total,):
        raise ValueError(f"direction has shape {tuple(direction.shape)}, need ({total},)")
    if not all_finite(direction):
        raise ValueError(_non_finite_direction(direction, parameters))
    offset = 0
    for parameter in parameters:
        size = parameter.numel()
        piece = direction[offset : offset + size].view_as(parameter)
        piece = piece.to(device=parameter.device, dtype=parameter.dtype)
        if accumulate and parameter.grad is not None:
            parameter.grad = parameter.grad + piece
        else:
            parameter.grad = piece.clone()
        offset += size


def _non_finite_direction(direction: torch.Tensor, parameters: list[torch.Tensor]) -> str:
    """Where a direction holds NaN/Inf: how many entries, the first one and its parameter."""
    bad = torch.nonzero(~torch.isfinite(direction)).flatten()
    first = int(bad[0])
    ends = torch.tensor([parameter.numel() for parameter in parameters]).cumsum(0)
    owner = int(torch.searchsorted(ends, first, right=True))
    return (
        f"the direction holds {len(bad)} non-finite entries (the first, "
        f"{float(direction[first])}, at index {first}, in parameter {owner}); nothing was "
        "written to .grad. Find the objective whose loss or gradient is NaN/Inf and fix "
        "or skip it (a harmonizer drops such objectives from its stack)"
    )


def accumulate_gradients(
    losses: Iterable[tuple[float, CombinableLoss]],
    parameters: Sequence[torch.Tensor],
    weights: torch.Tensor | None = None,
    count: int | None = None,
    apply_extra: bool = True,
    piece_stack: Callable[[CombinableLoss, bool], torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """Sum ``scale * gradient`` over a stream of (scale, CombinableLoss) pieces.

    With ``weights`` (K,) every piece is combined first and one backward per piece adds
    ``scale * (sum_k w_k grad L_k + grad extra)`` to ``.grad``; returns None. Without,
    returns the K x D stack ``sum scale * grad L_k`` of the pieces (gradient
    accumulation over micro-batches, one forward alive at a time), and only the
    non-harmonized ``extra`` terms go to ``.grad`` (left out with ``apply_extra=False``,
    for measurements that must leave ``.grad`` alone). Both are exact for the same
    weights: ``.grad + combine(stack, w)`` equals the weighted path's ``.grad``. An empty
    stream gives a zero stack of ``count`` rows. ``piece_stack(loss, retain_graph)`` gives
    a piece's stack (default: the K-backward
    [`combinable_gradients`][mogradient.engines.combinable_gradients]; the per-row engine passes its
    own).
    """
    parameters = list(parameters)
    if piece_stack is None:

        def piece_stack(loss: CombinableLoss, retain_graph: bool) -> torch.Tensor:
            return combinable_gradients(loss, parameters, retain_graph=retain_graph)

    stack = None
    for scale, loss in losses:
        if weights is not None:
            (loss.combined(weights) * scale).backward()
            continue
        extra = loss.extra if apply_extra else None
        part = piece_stack(loss, extra is not None)
        stack = part * scale if stack is None else stack.add_(part, alpha=scale)
        if extra is not None:
            (extra * scale).backward()
    if weights is None and stack is None:
        if count is None:
            raise ValueError("an empty stream of losses needs count (the number of objectives)")
        total = sum(parameter.numel() for parameter in parameters)
        stack = torch.zeros(count, total, device=parameters[0].device)
    return stack


def _sequential(
    losses: torch.Tensor,
    parameters: list[torch.Tensor],
    names: list[str] | None,
    retain_graph: bool,
) -> torch.Tensor:
    """One backward per loss; a parameter is unused only if no loss reached it."""
    rows, used = [], [False] * len(parameters)
    for index, loss in enumerate(losses):
        keep = retain_graph or index < len(losses) - 1
        grads = torch.autograd.grad(loss, parameters, retain_graph=keep, allow_unused=True)
        used = [seen or grad is not None for seen, grad in zip(used, grads, strict=True)]
        rows.append(_flatten(grads, parameters))
    _check_used(used, parameters, names)
    return torch.stack(rows)


def _batched_vjp(
    outputs: torch.Tensor,
    cotangents: torch.Tensor,
    parameters: list[torch.Tensor],
    names: list[str] | None,
    chunk_size: int | None,
    retain_graph: bool,
) -> torch.Tensor:
    """Rows ``cotangents @ d outputs / d parameters``, ``chunk_size`` rows per vmapped pass.

    All rows share one graph, so a parameter autograd reports unused is unused by every
    objective: checked on the first chunk.
    """
    count = cotangents.shape[0]
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 (or None for all at once), got {chunk_size}")
    chunk = count if chunk_size is None else int(chunk_size)
    rows = []
    for start in range(0, count, chunk):
        block = cotangents[start : start + chunk]
        keep = retain_graph or start + chunk < count
        grads = torch.autograd.grad(
            outputs,
            parameters,
            grad_outputs=block,
            retain_graph=keep,
            is_grads_batched=True,
            allow_unused=True,
        )
        if start == 0:
            _check_used([grad is not None for grad in grads], parameters, names)
        rows.append(torch.cat([grad.reshape(len(block), -1) for grad in grads], dim=1))
    return torch.cat(rows)


def flat_gradient(parameters: Sequence[torch.Tensor]) -> torch.Tensor:
    """The parameters' ``.grad`` as one flat vector (a missing gradient counts as zeros)."""
    return _flatten([parameter.grad for parameter in parameters], list(parameters))


def _flatten(grads: Sequence[torch.Tensor | None], parameters: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(
        [
            (torch.zeros_like(parameter) if grad is None else grad).reshape(-1)
            for grad, parameter in zip(grads, parameters, strict=True)
        ]
    )


def _checked_parameters(parameters: Parameters) -> tuple[list[torch.Tensor], list[str] | None]:
    """The tensors to differentiate, and their names when given as (name, tensor) pairs."""
    items = list(parameters.items() if isinstance(parameters, Mapping) else parameters)
    if not items:
        raise ValueError("the parameter set is empty: pass the parameters to differentiate")
    named = [isinstance(item, tuple) for item in items]
    if any(named) and not all(named):
        raise ValueError("pass either tensors or (name, tensor) pairs, not a mix")
    names = [str(item[0]) for item in items] if all(named) else None
    tensors = [item[1] for item in items] if all(named) else items
    frozen = [
        _describe(index, tensor, names)
        for index, tensor in enumerate(tensors)
        if not tensor.requires_grad
    ]
    if frozen:
        raise ValueError(f"parameters that do not require grad: {', '.join(frozen)}")
    shards = [_describe(i, t, names) for i, t in enumerate(tensors) if is_shard(t)]
    if shards:
        raise ValueError(
            f"{len(shards)} of {len(tensors)} parameters are FSDP2 shards (DTensor): "
            f"{', '.join(shards[:3])}. The forward reads all-gathered copies of them, so "
            "autograd cannot give their per-objective gradients. Fix: keep the trained "
            "parameters out of the shards, with mogradient.engines.shard_frozen (it shards "
            "the frozen weights only), or use DDP "
            "(mogradient.engines.distributed_objective_gradients)."
        )
    return tensors, names


def _check_used(
    used: Sequence[bool], parameters: list[torch.Tensor], names: list[str] | None
) -> None:
    """Raise for parameters that no objective reached (autograd returned no gradient)."""
    unused = [
        _describe(i, p, names)
        for i, (seen, p) in enumerate(zip(used, parameters, strict=True))
        if not seen
    ]
    if not unused:
        return
    shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
    raise UnusedParameterError(
        f"{len(unused)} of {len(parameters)} parameters are not in the graph of any "
        f"objective: {shown}. Their gradient would be silently zero. Likely causes: the "
        "parameter is not used by the forward (a disabled adapter or branch, a frozen "
        "submodule), or the tensors passed are not the ones the forward reads (copies, "
        "a state_dict's values). Fix: pass only parameters the losses depend on "
        "(select_parameters with a filter)."
    )


def _describe(index: int, parameter: torch.Tensor, names: list[str] | None) -> str:
    name = f" {names[index]!r}" if names is not None else ""
    return f"parameter {index}{name} (shape {tuple(parameter.shape)})"


def _stacked_losses(losses: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    if isinstance(losses, torch.Tensor):
        stacked = losses.reshape(-1) if losses.ndim <= 1 else None
    else:
        if len(losses) == 0:
            raise ValueError("no losses given")
        if any(loss.numel() != 1 for loss in losses):
            raise ValueError("each loss must be a scalar; reduce per-sample losses first")
        stacked = torch.stack([loss.reshape(()) for loss in losses])
    if stacked is None:
        raise ValueError(f"losses must be scalars or a 1-D tensor, got shape {tuple(losses.shape)}")
    if stacked.numel() == 0:
        raise ValueError("no losses given")
    return stacked
