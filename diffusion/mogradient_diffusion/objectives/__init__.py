"""RL objectives for multi-reward diffusion training, by config name.

``objective: {name: nft, ...options}`` in a config picks one; its options are the fields
of the objective's settings dataclass. Objectives live in their own modules and are
imported on first use, so a module's dependencies load only when it is chosen. The
interface they implement is :class:`~mogradient_diffusion.objectives.base.Objective`.
"""

from __future__ import annotations

import importlib
from typing import Any

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

# name -> "module:class"; the module defines the class with ``name`` equal to the key.
OBJECTIVES: dict[str, str] = {
    "nft": "mogradient_diffusion.objectives.nft:NFTObjective",
    "flow_grpo": "mogradient_diffusion.objectives.flow_grpo:FlowGRPOObjective",
    "sdpo": "mogradient_diffusion.objectives.sdpo:SDPOObjective",
}


class UnknownObjectiveError(KeyError):
    """An objective name that is not registered, or whose module is not available."""

    def __str__(self) -> str:
        return str(self.args[0])


def objective_class(name: str) -> type[Objective]:
    """The class registered under ``name``, imported on first use."""
    if name not in OBJECTIVES:
        raise UnknownObjectiveError(
            f"unknown objective {name!r}; choose one of {sorted(OBJECTIVES)}"
        )
    module_name, _, class_name = OBJECTIVES[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise
        raise UnknownObjectiveError(
            f"objective {name!r} is registered but its module {module_name} is not there"
        ) from None
    cls = getattr(module, class_name)
    if cls.name != name:
        raise RuntimeError(f"{OBJECTIVES[name]} is named {cls.name!r}, registered as {name!r}")
    return cls


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
