"""Multi-task backward through a shared representation: own gradients for the heads, a
harmonized one for the trunk.

A multi-task network computes shared features ``Z = trunk(x)`` and each task's loss from
its own head on ``Z``. Only what the tasks share needs harmonizing: each head's update is
its own loss's gradient, and the trunk's update combines the K per-task gradients of
the trunk. [`mtl_backward`][mogradient.engines.mtl_backward] does both in one call, and reaches the
trunk through the features: the K losses are differentiated down to ``Z`` (through the small heads),
and only from there into the trunk.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from typing import Literal

import torch

from mogradient.engines._stack import all_finite, write_gradient
from mogradient.errors import UnusedParameterError
from mogradient.harmonizers._base import Harmonization, Harmonizer

Mode = Literal["trunk", "features"]


def mtl_backward(
    losses: Sequence[torch.Tensor] | torch.Tensor,
    features: torch.Tensor | Sequence[torch.Tensor],
    harmonizer: Harmonizer,
    *,
    shared_parameters: Iterable[torch.Tensor] | None = None,
    head_parameters: Sequence[Iterable[torch.Tensor]] | None = None,
    mode: Mode = "trunk",
    method: str = "sequential",
    chunk_size: int | None = None,
    retain_graph: bool = False,
) -> Harmonization:
    """Give every head its own loss's gradient and the trunk a harmonized one; return the
    harmonization (weights, Gram, ...) for logging.

    ``losses`` are K scalars and ``features`` the shared representation they are computed
    from: a tensor, or several none of which is computed from another (a cut of the
    graph; a loss's gradient w.r.t. each is a total derivative). Gradients are *added*
    to ``.grad`` (a missing ``.grad`` counts as zeros), as ``loss.backward()`` and
    TorchJD do: zero them between steps.

    Parameters are found in the autograd graph unless given. ``shared_parameters`` default
    to the leaves the features are computed from; head k's to the leaves loss k reaches
    without passing through the features. A leaf that several losses reach that way (a
    shared scale after the features, a weight tied between trunk and a head) is shared,
    so it joins the trunk and is harmonized with it: its per-task gradients are total
    derivatives taken from each loss (which then walks the trunk once per task). Given
    sets are checked instead: a head parameter that another loss also reaches, or that is
    in another head or the trunk, raises ``ValueError`` (add it to ``shared_parameters``).

    ``mode="trunk"`` (exact) harmonizes the K x D Jacobian of the losses w.r.t. the
    shared parameters, obtained by back-propagating the K rows of the features' Jacobian
    through the trunk: the same direction as harmonizing the full trunk Jacobian, and as
    TorchJD's ``mtl_backward`` + ``jac_to_grad``. ``method="sequential"`` (default) runs
    K plain backward passes from the features; ``"batched"`` one vmapped pass with K
    cotangents (``chunk_size`` rows per pass), as TorchJD does. Why sequential: on CPU
    both took the same time within noise (benchmarks/results/representation.md), while
    the vmapped pass holds all K rows of every parameter's gradient next to the K x D
    stack (peak 60 vs 37 MiB at K = 8, 1e6 parameters, batch 64), and sequential needs
    no vmap rules for the trunk's ops. Batching may pay where per-op overhead dominates
    (many small kernels, a GPU; not measured here). The returned ``direction`` is the
    trunk's gradient, in the order of the shared parameters (given, or as found in the
    graph).

    ``mode="features"`` is MGDA-UB (Sener & Koltun 2018, NeurIPS; the name the authors'
    code, isl-org/MultiObjectiveOptimization, gives the method): the harmonizer's
    weights w are computed on the K gradients w.r.t. the features (flattened over the
    batch), and the trunk gets one backward of ``sum_k w_k loss_k``, exactly that weighted
    sum's gradient. This is the paper's upper-bound approximation, NOT the harmonization
    of the trunk's Jacobian: the weights are optimal for the feature gradients, and the
    harmonizer's guarantees hold there (for MGDA the paper shows the trunk still gets a
    common descent direction, or a Pareto-stationary point, when dZ/dtheta has full
    rank; UPGrad's non-conflict, for one, does not carry over). Only weights on the raw
    gradients can be transferred, so only linear harmonizers, whose update is a weighted
    sum of the gradients, make sense here; every mogradient harmonizer reports such
    weights. The returned ``direction`` and ``gram`` are those of the feature gradients
    (what the harmonizer saw). The cost is the heads' K backward passes and one ordinary
    backward of the trunk; ``method`` and ``chunk_size`` do not apply.

    Raises ``ValueError`` for losses that are not scalars or not differentiable, features
    that do not require grad, a loss that does not depend on the features, inconsistent
    parameter sets, and ``mode="features"`` with a coordinate-wise harmonizer
    (TrimmedMean, GradDrop: their weights do not give their direction);
    [`UnusedParameterError`][mogradient.errors.UnusedParameterError] for a shared parameter no loss
    reaches, and ``ValueError`` for a NaN/Inf loss, head gradient or trunk direction.
    Nothing is written to ``.grad`` when it raises.
    """
    if not isinstance(harmonizer, Harmonizer):
        raise TypeError(f"harmonizer must be a mogradient Harmonizer, got {type(harmonizer)}")
    if mode not in ("trunk", "features"):
        raise ValueError(f"unknown mode {mode!r}; use 'trunk' (exact) or 'features' (MGDA-UB)")
    if mode == "features" and not harmonizer.direction_is_weighted_sum:
        # Features mode applies the weights to the trunk through one weighted backward.
        raise ValueError(
            f"{type(harmonizer).__name__} computes its direction coordinate by coordinate, so "
            "its weights do not reproduce it on the trunk: use mode='trunk' with it"
        )
    if method not in ("batched", "sequential"):
        raise ValueError(f"unknown gradient method {method!r}; use 'batched' or 'sequential'")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 (or None for all at once), got {chunk_size}")
    losses = _checked_losses(losses)
    features = _checked_features(features)
    shared, heads, routed = _parameter_sets(losses, features, shared_parameters, head_parameters)

    # Each loss down to its own head, the features and, for the trunk's Jacobian, the
    # shared leaves it reaches directly (total derivatives). The graph is kept for the
    # trunk's pass; in features mode the weighted sum's backward covers those leaves.
    routed = routed if mode == "trunk" else []
    head_grads, feature_grads, routed_grads = [], [], []
    for loss, head in zip(losses, heads, strict=True):
        grads = torch.autograd.grad(
            loss, [*head, *features, *routed], retain_graph=True, allow_unused=True
        )
        head_grads.append(grads[: len(head)])
        feature_grads.append(
            _zeros_for_none(grads[len(head) : len(head) + len(features)], features)
        )
        routed_grads.append(grads[len(head) + len(features) :])

    if mode == "trunk":
        jacobian = _trunk_jacobian(
            features, feature_grads, shared, routed, routed_grads, method, chunk_size, retain_graph
        )
        harmonization = harmonizer(jacobian)
        direction = harmonization.direction
    else:
        flat = [torch.cat([grad.reshape(-1) for grad in row]) for row in feature_grads]
        harmonization = harmonizer(torch.stack(flat))
        direction = _weighted_sum_gradient(losses, harmonization.weights, shared, retain_graph)

    _check_finite_head_gradients(heads, head_grads)
    write_gradient(shared, direction, accumulate=True)  # raises, writing nothing, on NaN/Inf
    for head, grads in zip(heads, head_grads, strict=True):
        for parameter, grad in zip(head, grads, strict=True):
            parameter.grad = grad if parameter.grad is None else parameter.grad + grad
    return harmonization


def _checked_losses(losses: Sequence[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    if isinstance(losses, torch.Tensor):
        losses = list(losses.reshape(-1)) if losses.ndim == 1 else [losses]
    losses = list(losses)
    if not losses:
        raise ValueError("no losses given")
    for index, loss in enumerate(losses):
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(
                f"loss {index} has shape {shape}: each loss must be a scalar "
                "(reduce per-sample losses first)"
            )
        if not loss.requires_grad:
            raise ValueError(f"loss {index} does not require grad: it is not differentiable")
    # One transfer of K numbers. Why refuse: a NaN loss gives its head NaN gradients,
    # and one optimizer step on them spoils that head for good.
    values = torch.stack([loss.detach().reshape(()).double().cpu() for loss in losses]).tolist()
    for index, value in enumerate(values):
        if not math.isfinite(value):
            raise ValueError(
                f"loss {index} is {value}: every loss must be finite (nothing was written to "
                ".grad); fix that task's loss computation, or skip the step"
            )
    return [loss.reshape(()) for loss in losses]


def _check_finite_head_gradients(
    heads: list[list[torch.Tensor]], head_grads: list[tuple[torch.Tensor | None, ...]]
) -> None:
    """Refuse NaN/Inf in a head's gradient before anything is written (one device sync)."""
    places = [
        (task, index, grad)
        for task, grads in enumerate(head_grads)
        for index, grad in enumerate(grads)
        if grad is not None
    ]
    if not places:
        return
    device = places[0][2].device
    sums = torch.stack([grad.sum().to(device) for *_, grad in places])
    if bool(torch.isfinite(sums).all()):
        return  # NaN and Inf make a sum non-finite: one sync for all heads
    for task, index, grad in places:
        if not all_finite(grad):
            shape = tuple(heads[task][index].shape)
            raise ValueError(
                f"loss {task}'s gradient w.r.t. parameter {index} of head {task} (shape "
                f"{shape}) holds NaN or Inf although the loss is finite; nothing was written "
                "to .grad. Fix that head's computation, or skip the step"
            )


def _checked_features(features: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    features = [features] if isinstance(features, torch.Tensor) else list(features)
    if not features:
        raise ValueError("no features given: pass the trunk's output that the heads read")
    for index, feature in enumerate(features):
        if not feature.requires_grad:
            raise ValueError(
                f"features {index} do not require grad: pass the trunk's output as computed "
                "with grad enabled (not detached, not under torch.no_grad())"
            )
    # A loss's gradient w.r.t. a feature is a total derivative: one computed from another
    # would have its part through the other counted twice on the way into the trunk.
    for index, feature in enumerate(features if len(features) > 1 else []):
        others = features[:index] + features[index + 1 :]
        _, reached = _leaves_before([feature], others)
        if reached:
            other = min(reached) + (min(reached) >= index)
            raise ValueError(
                f"features {index} are computed from features {other}: pass tensors "
                "none of which is computed from another (a cut of the graph)"
            )
    return features


def _parameter_sets(
    losses: list[torch.Tensor],
    features: list[torch.Tensor],
    shared_parameters: Iterable[torch.Tensor] | None,
    head_parameters: Sequence[Iterable[torch.Tensor]] | None,
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]], list[torch.Tensor]]:
    """The shared parameters, each head's, and the shared ones some loss reaches directly.

    Decided on the graph's structure, before any gradient is computed, so that a bad
    configuration raises before anything is written.
    """
    direct = []
    for index, loss in enumerate(losses):
        leaves, reached = _leaves_before([loss], features)
        if not reached:
            raise ValueError(
                f"loss {index} does not depend on the features: its head must read the "
                "features passed here (not a detached or recomputed copy)"
            )
        direct.append(leaves)
    reach: dict[int, int] = {}
    for leaves in direct:
        for key in leaves:
            reach[key] = reach.get(key, 0) + 1
    trunk, _ = _leaves_before(features, [])

    if shared_parameters is None:
        also = {
            key: leaf
            for leaves in direct
            for key, leaf in leaves.items()
            if reach[key] > 1 or key in trunk
        }
        shared = list({**trunk, **also}.values())
        if not shared:
            raise ValueError("the features are not computed from any parameter: nothing shared")
    else:
        shared = list({id(parameter): parameter for parameter in shared_parameters}.values())
        if not shared:
            raise ValueError("shared_parameters is empty")
        for index, parameter in enumerate(shared):
            where = f"shared parameter {index} (shape {tuple(parameter.shape)})"
            if not parameter.requires_grad:
                raise ValueError(f"{where} does not require grad")
            if id(parameter) not in trunk and id(parameter) not in reach:
                raise UnusedParameterError(
                    f"{where} is not in the graph of the features nor of any loss: its "
                    "gradient would be silently zero; pass the parameters the trunk uses"
                )
    shared_ids = {id(parameter) for parameter in shared}

    if head_parameters is None:
        heads = [
            [leaf for key, leaf in leaves.items() if key not in shared_ids] for leaves in direct
        ]
    else:
        heads = [list(head) for head in head_parameters]
        if len(heads) != len(losses):
            raise ValueError(f"got parameters for {len(heads)} heads but {len(losses)} losses")
    owner: dict[int, int] = {}
    for task, head in enumerate(heads):
        for index, parameter in enumerate(head):
            key = id(parameter)
            where = f"parameter {index} of head {task} (shape {tuple(parameter.shape)})"
            if key in shared_ids or key in owner:
                other = "the shared parameters" if key in shared_ids else f"head {owner[key]}"
                raise ValueError(f"{where} is also in {other}: a parameter has one owner")
            if key not in direct[task]:
                raise ValueError(
                    f"{where} is not reached by loss {task} outside the features: a head "
                    "parameter must be used by its own head, after the features"
                )
            if reach[key] > 1:
                raise ValueError(
                    f"{where} is reached by several losses: it is shared, so its update must "
                    "be harmonized; pass it in shared_parameters"
                )
            owner[key] = task
    routed = [parameter for parameter in shared if id(parameter) in reach]
    return shared, heads, routed


def _leaves_before(
    roots: Sequence[torch.Tensor], stop: Sequence[torch.Tensor]
) -> tuple[dict[int, torch.Tensor], set[int]]:
    """The leaves (by id) that ``roots`` reach in the autograd graph without passing
    through a tensor of ``stop``, and the indices of the ``stop`` tensors reached.

    Edges are told apart by output number, so outputs of one node (``torch.split``) are
    distinct tensors here, as they are to autograd.
    """
    barrier = {(t.grad_fn, t.output_nr): i for i, t in enumerate(stop) if t.grad_fn is not None}
    stop_leaves = {id(t): i for i, t in enumerate(stop) if t.grad_fn is None}
    leaves: dict[int, torch.Tensor] = {}
    reached: set[int] = set()
    seen = set()
    pending = [(root.grad_fn, root.output_nr) for root in roots if root.grad_fn is not None]
    while pending:
        edge = pending.pop()
        if edge in barrier:
            reached.add(barrier[edge])
            continue
        node = edge[0]
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # set on AccumulateGrad, a leaf's node
        if variable is None:
            pending.extend(child for child in node.next_functions if child[0] is not None)
        elif id(variable) in stop_leaves:
            reached.add(stop_leaves[id(variable)])
        else:
            leaves[id(variable)] = variable
    return leaves, reached


def _trunk_jacobian(
    features: list[torch.Tensor],
    feature_grads: list[list[torch.Tensor]],
    shared: list[torch.Tensor],
    routed: list[torch.Tensor],
    routed_grads: list[tuple[torch.Tensor | None, ...]],
    method: str,
    chunk_size: int | None,
    retain_graph: bool,
) -> torch.Tensor:
    """K x D per-task gradients of the shared parameters.

    Parameters only the features reach get row k by back-propagating loss k's gradient
    w.r.t. the features through the trunk; the ones a loss also reaches directly already
    have their total derivatives from the per-loss pass.
    """
    count = len(feature_grads)
    offsets, total = {}, 0
    for parameter in shared:
        offsets[id(parameter)] = total
        total += parameter.numel()
    dtype = _common_dtype(shared)
    jacobian = torch.zeros(count, total, dtype=dtype, device=shared[0].device)

    def fill(
        rows: slice, parameters: list[torch.Tensor], grads: Sequence[torch.Tensor | None]
    ) -> None:
        for parameter, grad in zip(parameters, grads, strict=True):
            if grad is not None:
                start = offsets[id(parameter)]
                block = jacobian[rows, start : start + parameter.numel()]
                block.copy_(grad.reshape(block.shape))

    for task, grads in enumerate(routed_grads):
        fill(slice(task, task + 1), routed, grads)
    routed_ids = {id(parameter) for parameter in routed}
    through = [parameter for parameter in shared if id(parameter) not in routed_ids]
    if not through:
        return jacobian
    cotangents = [
        torch.stack([row[index] for row in feature_grads]) for index in range(len(features))
    ]
    step = 1 if method == "sequential" else count if chunk_size is None else chunk_size
    for start in range(0, count, step):
        rows = slice(start, start + step)
        grads = torch.autograd.grad(
            features,
            through,
            grad_outputs=[
                cotangent[start] if method == "sequential" else cotangent[rows]
                for cotangent in cotangents
            ],
            retain_graph=retain_graph or start + step < count,
            is_grads_batched=method != "sequential",
            allow_unused=True,
        )
        fill(rows, through, grads)
    return jacobian


def _weighted_sum_gradient(
    losses: list[torch.Tensor],
    weights: torch.Tensor,
    shared: list[torch.Tensor],
    retain_graph: bool,
) -> torch.Tensor:
    """The flat gradient of ``sum_k w_k loss_k`` w.r.t. ``shared``: one backward.

    Zero-weight losses are left out, so that a non-finite gradient never leaks (0 * NaN).
    """
    terms = [
        weight * loss for weight, loss in zip(weights.tolist(), losses, strict=True) if weight != 0
    ]
    if not terms:
        dtype = _common_dtype(shared)
        size = sum(parameter.numel() for parameter in shared)
        return torch.zeros(size, dtype=dtype, device=shared[0].device)
    grads = torch.autograd.grad(
        torch.stack(terms).sum(), shared, retain_graph=retain_graph, allow_unused=True
    )
    return torch.cat([grad.reshape(-1) for grad in _zeros_for_none(grads, shared)])


def _common_dtype(parameters: list[torch.Tensor]) -> torch.dtype:
    """The dtype that holds every parameter's gradient without rounding."""
    return functools.reduce(torch.promote_types, [parameter.dtype for parameter in parameters])


def _zeros_for_none(
    grads: Sequence[torch.Tensor | None], tensors: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """Autograd's None (this output does not reach that input) as zeros."""
    return [
        torch.zeros_like(tensor) if grad is None else grad
        for grad, tensor in zip(grads, tensors, strict=True)
    ]
