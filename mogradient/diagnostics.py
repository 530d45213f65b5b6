"""Conflict diagnostics: how the applied direction aligns with each objective's gradient.

Everything is computed from the K x K Gram matrix and the weights, so it costs nothing
extra once a full solve has built the Gram: cos(d, g_k) = (G w)_k / (||g_k|| ||d||).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from mogradient.gram import gram_matrix

ANTI_ALIGNED_BELOW = 0.0
# A direction shorter than this fraction of the largest gradient is round-off: the step
# is Pareto-stationary and its cosines are undefined.
STATIONARY_BELOW = 1e-10


def conflict_diagnostics(
    weights: torch.Tensor,
    *,
    jacobian: torch.Tensor | None = None,
    gram: torch.Tensor | None = None,
    dropped: tuple[int, ...] = (),
    fallback: str | None = None,
) -> dict[str, float | int | str | list[int] | None]:
    """One step's diagnostics as a flat dict ready for a logger.

    Keys: ``cos/k``, ``cos_min``, ``cos_mean``, ``cos_var`` (population variance over the
    objectives with a usable gradient), ``anti_aligned`` (1 if some cos < 0),
    ``norm/k``, ``weight/k``, ``direction_norm``, ``stationary`` (1 when the direction is
    round-off of the gradients' scale, cosines then NaN), ``dropped``, ``fallback``.
    """
    if (jacobian is None) == (gram is None):
        raise ValueError("pass exactly one of jacobian= or gram=")
    gram = gram_matrix(jacobian) if jacobian is not None else gram.to(torch.float64).cpu()
    weights = torch.as_tensor(weights, dtype=torch.float64).cpu()
    if weights.shape != (gram.shape[0],):
        raise ValueError(f"{gram.shape[0]} objectives but weights of shape {tuple(weights.shape)}")
    norms = torch.sqrt(torch.diagonal(gram).clamp_min(0))
    usable = torch.isfinite(norms) & (norms > 0)
    clean = torch.where(usable[:, None] & usable[None, :], gram, torch.zeros_like(gram))
    used_weights = torch.where(usable, weights, torch.zeros_like(weights))
    direction_norm = math.sqrt(max(float(used_weights @ clean @ used_weights), 0.0))
    cosines = torch.full_like(norms, math.nan)
    largest = float(norms[usable].max()) if usable.any() else 0.0
    stationary = direction_norm <= STATIONARY_BELOW * largest
    if not stationary:
        cosines[usable] = (clean @ used_weights)[usable] / (norms[usable] * direction_norm)
    finite = cosines[torch.isfinite(cosines)]
    record: dict[str, float | int | str | list[int] | None] = {}
    for index in range(len(weights)):
        record[f"cos/{index}"] = float(cosines[index])
        record[f"norm/{index}"] = float(norms[index]) if usable[index] else math.nan
        record[f"weight/{index}"] = float(weights[index])
    record["cos_min"] = float(finite.min()) if len(finite) else math.nan
    record["cos_mean"] = float(finite.mean()) if len(finite) else math.nan
    record["cos_var"] = float(finite.var(unbiased=False)) if len(finite) else math.nan
    record["anti_aligned"] = int(bool(len(finite)) and float(finite.min()) < ANTI_ALIGNED_BELOW)
    record["direction_norm"] = direction_norm
    record["stationary"] = int(stationary)
    record["dropped"] = sorted(set(dropped) | set(torch.nonzero(~usable).flatten().tolist()))
    record["fallback"] = fallback
    return record


@dataclass
class ConflictAccumulator:
    """Run-level summary of per-step diagnostics (the paper's conflict table)."""

    history: list[dict] = field(default_factory=list)

    def add(self, record: dict) -> None:
        self.history.append(record)

    def summary(self) -> dict[str, float | int]:
        """Fraction of steps with a negative worst cosine, mean worst cosine, mean variance."""
        minima = [r["cos_min"] for r in self.history if math.isfinite(r["cos_min"])]
        variances = [r["cos_var"] for r in self.history if math.isfinite(r["cos_var"])]
        fallbacks = sum(1 for r in self.history if r.get("fallback"))
        return {
            "steps": len(self.history),
            "negative_min_cos_fraction": _mean([float(m < 0) for m in minima]),
            "mean_min_cos": _mean(minima),
            "mean_cos_var": _mean(variances),
            "fallback_steps": fallbacks,
        }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan
