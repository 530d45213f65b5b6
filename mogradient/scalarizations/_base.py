"""The scalarization contract: K task losses (with graph) in, one loss to backpropagate out.

Loss-based methods never see gradients, so they do not fit the harmonizer contract
(a gradient stack in, weights on it out); the input here is the loss vector itself and
the output is a scalar whose ordinary ``backward()`` trains the model. A scalarization
is an ``nn.Module`` because that is what its state needs: learnable parameters
(``parameters()``, added to the user's optimizer), buffers that follow the model with
``.to(device)``, and a ``state_dict`` that a checkpoint saves and ``load_state_dict``
restores strictly.

A step, in order::

    result = scalarization(losses)          # validate, scalarize
    result.loss.backward()
    optimizer.step()                        # optimizer holds model + scalarization.parameters()
    if scalarization.needs_losses_after_step:
        with torch.no_grad():
            scalarization.update(recomputed_losses)   # same batch, after the step (FAMO)
    ...
    scalarization.end_epoch()               # once per epoch (DWA); a no-op for the others
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn


@dataclass(frozen=True)
class ScalarizedLoss:
    """What a scalarization returns: the loss to backpropagate and the weights it used.

    ``weights[k]`` is d loss / d L_k at the current losses, the factor the task's
    gradient gets in ``loss.backward()`` (the same meaning as a harmonizer's weights on
    the raw gradients, so they can go to
    [`mogradient.conflict_diagnostics`][mogradient.diagnostics.conflict_diagnostics]). Detached, on
    the losses' device. They need not be positive or sum to anything: PBI's can be negative.
    ``extras`` holds method-specific values worth logging.
    """

    loss: torch.Tensor
    weights: torch.Tensor
    extras: dict[str, Any] = field(default_factory=dict)


class Scalarization(nn.Module, ABC):
    """Base class: validate the loss vector, delegate to
    [`scalarize`][mogradient.scalarizations.Scalarization.scalarize].

    ``num_tasks`` pins K: required by methods with per-task state (they size it at
    construction so that ``parameters()`` exist before the optimizer is built), optional
    for the others, where it only makes every call check the count.
    """

    # Whether :meth:`update` must get the losses recomputed after the optimizer step.
    needs_losses_after_step: ClassVar[bool] = False

    def __init__(self, num_tasks: int | None = None) -> None:
        super().__init__()
        if num_tasks is not None and (
            isinstance(num_tasks, bool) or not isinstance(num_tasks, int) or num_tasks < 1
        ):
            raise ValueError(f"num_tasks must be a positive integer, got {num_tasks!r}")
        self.num_tasks = num_tasks

    def forward(self, losses: torch.Tensor | Sequence[torch.Tensor]) -> ScalarizedLoss:
        losses = self.validated_losses(losses)
        return self.scalarize(losses)

    def __call__(self, losses: torch.Tensor | Sequence[torch.Tensor]) -> ScalarizedLoss:
        """Scalarize K task losses: a 1-D tensor, or a sequence of scalar tensors."""
        return super().__call__(losses)

    @abstractmethod
    def scalarize(self, losses: torch.Tensor) -> ScalarizedLoss:
        """The method: ``losses`` is a validated 1-D floating tensor of K finite values."""

    def check_domain(self, values: torch.Tensor) -> None:
        """Raise ValueError if a loss is outside the method's domain (e.g. log of a non-positive).

        ``values`` is a detached float64 CPU copy of the losses. The default accepts any
        finite loss.
        """

    def update(self, losses_after_step: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """Learn from the losses recomputed after the step (if ``needs_losses_after_step``)."""
        raise TypeError(
            f"{type(self).__name__} does not learn from the losses after the step; "
            "call update() only when needs_losses_after_step is True"
        )

    def end_epoch(self) -> None:
        """Mark the end of an epoch. Methods that keep per-epoch statistics (DWA) override this."""

    def validated_losses(self, losses: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
        """K losses as a 1-D floating tensor (graph kept), checked finite and in the domain."""
        name = type(self).__name__
        if not isinstance(losses, torch.Tensor):
            losses = list(losses)
            if not all(isinstance(loss, torch.Tensor) and loss.numel() == 1 for loss in losses):
                raise TypeError(f"{name}: give the losses as a 1-D tensor or a list of scalars")
            losses = torch.stack([loss.reshape(()) for loss in losses]) if losses else None
        if losses is None or losses.ndim != 1 or len(losses) == 0:
            got = "no losses" if losses is None else f"shape {tuple(losses.shape)}"
            raise ValueError(f"{name}: the losses must be K >= 1 scalars (a 1-D tensor), got {got}")
        if not losses.is_floating_point():
            raise TypeError(f"{name}: the losses must be floating point, got {losses.dtype}")
        if self.num_tasks is not None and len(losses) != self.num_tasks:
            raise ValueError(
                f"{name} was built for {self.num_tasks} tasks but got {len(losses)} losses"
            )
        # One transfer of K numbers: what every check below reads.
        values = losses.detach().to("cpu", torch.float64)
        for task, value in enumerate(values.tolist()):
            if not math.isfinite(value):
                raise ValueError(
                    f"{name}: task {task}'s loss is {value}; a scalarization needs finite "
                    "losses (check that task's loss computation, or skip the step)"
                )
        self.check_domain(values)
        return losses

    def extra_repr(self) -> str:
        return ", ".join(
            f"{key}={value!r}"
            for key, value in vars(self).items()
            if not key.startswith("_") and key != "training"
        )


def check_at_least(
    method: str, values: torch.Tensor, bounds: torch.Tensor, strict: bool, why: str, fix: str
) -> None:
    """Raise a ValueError naming the first task whose loss is below (or at) its bound."""
    bad = values <= bounds if strict else values < bounds
    if bad.any():
        task = int(torch.nonzero(bad)[0])
        relation = "above" if strict else "at least"
        raise ValueError(
            f"{method}: task {task}'s loss is {float(values[task])!r} but must be {relation} "
            f"{float(bounds[task])!r} ({why}); {fix}"
        )


def checked_vector(
    vector: Sequence[float] | torch.Tensor | None,
    name: str,
    non_negative: bool,
    num_tasks: int | None,
) -> torch.Tensor | None:
    """A 1-D finite float64 copy of a per-task setting (preferences, reference point)."""
    if vector is None:
        return None
    vector = torch.as_tensor(vector, dtype=torch.float64).detach().cpu().clone()
    if vector.ndim != 1 or len(vector) == 0 or not torch.isfinite(vector).all():
        raise ValueError(f"{name} must be a non-empty 1-D list of finite numbers")
    if non_negative and ((vector < 0).any() or vector.sum() <= 0):
        raise ValueError(f"{name} must be non-negative and not all zero")
    if num_tasks is not None and len(vector) != num_tasks:
        raise ValueError(f"{name} has {len(vector)} entries but num_tasks is {num_tasks}")
    return vector


def positive(value: float, name: str) -> float:
    """A finite, strictly positive hyperparameter."""
    if not (isinstance(value, int | float) and 0 < value < math.inf):
        raise ValueError(f"{name} must be finite and positive, got {value!r}")
    return float(value)


def non_negative(value: float, name: str) -> float:
    """A finite, non-negative hyperparameter."""
    if not (isinstance(value, int | float) and 0 <= value < math.inf):
        raise ValueError(f"{name} must be finite and non-negative, got {value!r}")
    return float(value)


def preferences_and_reference(
    num_tasks: int | None,
    preferences: Sequence[float] | torch.Tensor | None,
    reference: Sequence[float] | torch.Tensor | None,
) -> tuple[int | None, torch.Tensor | None, torch.Tensor | None]:
    """A preference-based method's K, preference vector and reference point, checked
    against each other: a vector given fixes K for the rest."""
    preferences = checked_vector(preferences, "preferences", True, num_tasks)
    if preferences is not None:
        num_tasks = len(preferences)
    reference = checked_vector(reference, "reference", False, num_tasks)
    if reference is not None:
        num_tasks = len(reference)
    return num_tasks, preferences, reference
