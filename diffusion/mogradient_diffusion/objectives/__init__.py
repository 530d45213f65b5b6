"""RL objectives for multi-reward diffusion training, by config name.

``objective: {name: nft, ...options}`` in a config picks one; its options are the fields
of the objective's settings dataclass. Objectives live in their own modules and are
imported on first use, so a module's dependencies load only when it is chosen; an unknown
name fails with the choices and the closest ones (``UnknownObjectiveError``). The
interface they implement is [`Objective`][mogradient_diffusion.objectives.base.Objective].
"""

from __future__ import annotations

from typing import Any

from mogradient.registry import Registry, UnknownNameError
from mogradient_diffusion.objectives.base import (
    Advantages,
    Objective,
    RewardView,
    RolloutData,
    RolloutRequest,
    Scorer,
    Stateless,
    StepMetrics,
    TrainPiece,
)

# Each module defines its class with ``name`` equal to the name it is registered under.
OBJECTIVES: Registry[type[Objective]] = Registry("objective")
OBJECTIVES.add("nft", "mogradient_diffusion.objectives.nft:NFTObjective")
OBJECTIVES.add("flow_grpo", "mogradient_diffusion.objectives.flow_grpo:FlowGRPOObjective")
OBJECTIVES.add("sdpo", "mogradient_diffusion.objectives.sdpo:SDPOObjective")

# The config loader catches an unknown objective under this name.
UnknownObjectiveError = UnknownNameError


def objective_class(name: str) -> type[Objective]:
    """The class registered under ``name``, imported on first use."""
    return OBJECTIVES[name]


def build_objective(name: str, settings: Any) -> Objective:
    """An objective of class ``name`` with its settings (an instance of its settings_type)."""
    cls = objective_class(name)
    if not isinstance(settings, cls.settings_type):
        raise TypeError(
            f"objective {name!r} takes {cls.settings_type.__name__} settings, "
            f"got {type(settings).__name__}"
        )
    return cls(settings)


__all__ = [
    "OBJECTIVES",
    "Advantages",
    "Objective",
    "RewardView",
    "RolloutData",
    "RolloutRequest",
    "Scorer",
    "Stateless",
    "StepMetrics",
    "TrainPiece",
    "UnknownObjectiveError",
    "build_objective",
    "objective_class",
]
