"""Conflict diagnostics: how the applied direction aligns with each objective's gradient.

With the gradient stack at hand, cosines are computed from the explicit direction d
(one extra pass: J @ d), which is accurate to the stack's precision. From a Gram matrix
alone they come out of w^T G w, which loses half the digits to cancellation when d is
short. Both the floor below which a step counts as stationary (cosines NaN) and the
tolerance on anti-alignment derive from the precision the gradients had.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from mogradient.harmonizers._base import combine

# Cosines are rounded quantities: an objective is anti-aligned only when its cosine is
# below minus the step's round-off bound, and never for cos >= -1e-6.
MIN_COS_TOLERANCE = 1e-6


def conflict_diagnostics(
    weights: torch.Tensor,
    *,
    jacobian: torch.Tensor | None = None,
    gram: torch.Tensor | None = None,
    direction: torch.Tensor | None = None,
    source_dtype: torch.dtype = torch.float32,
    dropped: tuple[int, ...] = (),
    fallback: str | None = None,
) -> dict[str, float | int | str | list[int] | None]:
    """One step's diagnostics as a flat dict ready for a logger.

    Pass ``jacobian`` (K x D; ``direction`` reuses an already combined d) for exact
    cosines, or ``gram`` alone (``source_dtype``: precision of the gradients it came from).
    Keys: ``cos/k``, ``cos_min``, ``cos_mean``, ``cos_var`` (population variance over the
    objectives with a usable gradient), ``cos_tolerance`` (first-order round-off bound of
    the cosines, eps * sum_k |w_k| ||g_k|| / ||d||, at least 1e-6), ``anti_aligned`` (1 if
    some cos < -cos_tolerance),
    ``norm/k``, ``weight/k``, ``direction_norm``, ``stationary`` (1 when d is below the
    round-off floor, cosines then NaN), ``dropped``, ``fallback``.
    """
    if (jacobian is None) == (gram is None):
        raise ValueError("pass exactly one of jacobian= or gram=")
    weights = torch.as_tensor(weights, dtype=torch.float64).cpu()
    if jacobian is not None:
        norms, dots, direction_norm, source_dtype = _from_jacobian(jacobian, weights, direction)
    else:
        norms, dots, direction_norm = _from_gram(gram.to(torch.float64).cpu(), weights)
    usable = torch.isfinite(norms) & (norms > 0)
    scale = float((weights.abs() * torch.where(usable, norms, torch.zeros_like(norms))).sum())
    # Below sqrt(eps) of the scale, weights solved to ~eps accuracy (and w^T G w) no
    # longer determine the direction's angle: the step is stationary.
    stationary = direction_norm <= math.sqrt(torch.finfo(source_dtype).eps) * scale
    cosines = torch.full_like(norms, math.nan)
    tolerance = math.nan
    if not stationary:
        cosines[usable] = (dots[usable] / (norms[usable] * direction_norm)).clamp(-1.0, 1.0)
        relative = torch.finfo(source_dtype).eps * scale / direction_norm
        if jacobian is None:  # ||d|| itself comes from the cancelling w^T G w
            relative += relative * scale / direction_norm
        tolerance = max(MIN_COS_TOLERANCE, relative)
    record = _record(weights, norms, usable, cosines, direction_norm, stationary, tolerance)
    record["dropped"] = sorted(set(dropped) | set(record["dropped"]))
    record["fallback"] = fallback
    return record


def _from_jacobian(
    jacobian: torch.Tensor, weights: torch.Tensor, direction: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, float, torch.dtype]:
    if weights.shape != (jacobian.shape[0],):
        raise ValueError(
            f"{jacobian.shape[0]} objectives but weights of shape {tuple(weights.shape)}"
        )
    # Half-precision products overflow: measure in at least float32.
    compute = torch.promote_types(jacobian.dtype, torch.float32)
    norms = torch.linalg.vector_norm(jacobian, dim=1, dtype=compute).to(torch.float64).cpu()
    direction = combine(jacobian, weights) if direction is None else direction
    dots = (jacobian.to(compute) @ direction.to(compute)).to(torch.float64).cpu()
    direction_norm = float(torch.linalg.vector_norm(direction.to(torch.float64)))
    return norms, dots, direction_norm, jacobian.dtype


def _from_gram(
    gram: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, float]:
    if weights.shape != (gram.shape[0],):
        raise ValueError(f"{gram.shape[0]} objectives but weights of shape {tuple(weights.shape)}")
    norms = torch.sqrt(torch.diagonal(gram).clamp_min(0))
    usable = torch.isfinite(norms) & (norms > 0)
    clean = torch.where(usable[:, None] & usable[None, :], gram, torch.zeros_like(gram))
    used_weights = torch.where(usable, weights, torch.zeros_like(weights))
    direction_norm = math.sqrt(max(float(used_weights @ clean @ used_weights), 0.0))
    return norms, clean @ used_weights, direction_norm


def _record(weights, norms, usable, cosines, direction_norm, stationary, tolerance):
    finite = cosines[torch.isfinite(cosines)]
    record: dict[str, float | int | str | list[int] | None] = {}
    for index in range(len(weights)):
        record[f"cos/{index}"] = float(cosines[index])
        record[f"norm/{index}"] = float(norms[index]) if usable[index] else math.nan
        record[f"weight/{index}"] = float(weights[index])
    record["cos_min"] = float(finite.min()) if len(finite) else math.nan
    record["cos_mean"] = float(finite.mean()) if len(finite) else math.nan
    record["cos_var"] = float(finite.var(unbiased=False)) if len(finite) else math.nan
    record["cos_tolerance"] = tolerance
    record["anti_aligned"] = int(bool(len(finite)) and float(finite.min()) < -tolerance)
    record["direction_norm"] = direction_norm
    record["stationary"] = int(stationary)
    record["dropped"] = torch.nonzero(~usable).flatten().tolist()
    return record


@dataclass
class ConflictAccumulator:
    """Run-level summary of per-step diagnostics (the paper's conflict table)."""

    history: list[dict] = field(default_factory=list)

    def add(self, record: dict) -> None:
        self.history.append(record)

    def summary(self) -> dict[str, float | int]:
        """Fraction of steps with an anti-aligned objective, mean worst cosine, mean variance."""
        measured = [r for r in self.history if math.isfinite(r["cos_min"])]
        minima = [r["cos_min"] for r in measured]
        variances = [r["cos_var"] for r in self.history if math.isfinite(r["cos_var"])]
        return {
            "steps": len(self.history),
            "negative_min_cos_fraction": _mean([float(r["anti_aligned"]) for r in measured]),
            "mean_min_cos": _mean(minima),
            "mean_cos_var": _mean(variances),
            "stationary_steps": sum(int(r.get("stationary", 0)) for r in self.history),
            "fallback_steps": sum(1 for r in self.history if r.get("fallback")),
        }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan
