"""What a step's per-reward gradients say beyond the update: conflicts, and staleness.

The conflict probe measures steps that did not solve (scalar baselines, cached MARBLE
steps) on the same footing as solve steps: cos(applied update, g_k) for every reward.
For cached MGDA steps it also says how far the applied update is from a fresh solve.
"""

from __future__ import annotations

import torch

from mogradient import conflict_diagnostics
from mogradient.harmonizers import MGDA
from mogradient_diffusion.runs import metric_keys as keys
from mogradient_diffusion.strategies import Strategy


def probe_record(
    stack: torch.Tensor, direction: torch.Tensor, strategy: Strategy
) -> dict[str, float]:
    """Conflict diagnostics of the applied ``direction`` against the per-reward ``stack``
    (K x D), with the staleness of a cached MGDA step when there is one."""
    count = stack.shape[0]
    diagnostics = conflict_diagnostics(torch.ones(count), jacobian=stack, direction=direction)
    record = {  # no weight/k: the probe's unit weights only set the round-off tolerance
        keys.harmonize(k): v
        for k, v in diagnostics.items()
        if not isinstance(v, list) and not k.startswith("weight/")
    }
    return record | staleness(strategy, stack, direction)


def staleness(strategy: Strategy, stack: torch.Tensor, direction: torch.Tensor) -> dict[str, float]:
    """How far a cached MARBLE step is from what a fresh solve would apply now.

    Only for MGDA (stateless, so solving here does not change the run): cos between
    the applied update and the fresh direction, and the fresh update's worst cosine.
    """
    amortizer = strategy.amortizer
    if strategy.scalar_weights is not None or not isinstance(amortizer.harmonizer, MGDA):
        return {}
    objectives = stack
    if strategy.micro_step is not None:  # its groups' gradients; the trainer logs its staleness
        objectives = strategy.micro_step.objective_stack(stack)
    fresh = amortizer.harmonizer(objectives)
    if fresh.direction is None or not fresh.weights.any():
        return {}
    fresh_diagnostics = conflict_diagnostics(fresh.weights, jacobian=objectives)
    cosine = torch.nn.functional.cosine_similarity(
        direction.double(), fresh.direction.double(), dim=0
    )
    record = {
        keys.COS_TO_FRESH: float(cosine),
        keys.FRESH_COS_MIN: float(fresh_diagnostics["cos_min"]),
    }
    if strategy.micro_step is None:
        record[keys.STEPS_SINCE_SOLVE] = float(amortizer.steps_since_solve or 0)
    return record
