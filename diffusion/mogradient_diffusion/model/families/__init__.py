"""Model families: each diffusers pipeline class the trainer can train, found by its name.

A family holds no state, so the registry holds one instance of each; a new one joins
with ``FAMILIES.add(family.name, family)``.
"""

from __future__ import annotations

import json
from pathlib import Path

from mogradient.registry import Registry
from mogradient_diffusion.model.families.base import Family
from mogradient_diffusion.model.families.flux import Flux
from mogradient_diffusion.model.families.qwen_image import QwenImage
from mogradient_diffusion.model.families.sd3 import SD3

FAMILIES: Registry[Family] = Registry("model family")
FAMILIES.add(SD3.name, SD3())
FAMILIES.add(Flux.name, Flux())
FAMILIES.add(QwenImage.name, QwenImage())


def family_named(name: str) -> Family:
    """The family called ``name`` (``model.family``); an unknown name is an UnknownNameError
    (a ValueError) with the choices and the closest ones."""
    return FAMILIES[name]


def family_of_pipeline_class(class_name: str) -> Family:
    """The family whose pipeline class is ``class_name`` (``_class_name`` of model_index.json)."""
    for family in FAMILIES.values():
        if family.pipeline_class_name == class_name:
            return family
    known = ", ".join(f"{f.pipeline_class_name} ({f.name})" for f in FAMILIES.values())
    raise ValueError(f"no model family trains a {class_name}; supported: {known}")


def detect_family(path: str | Path) -> Family:
    """The family of a saved pipeline directory, from its model_index.json."""
    index = Path(path).expanduser() / "model_index.json"
    class_name = json.loads(index.read_text()).get("_class_name")
    if not isinstance(class_name, str):
        raise ValueError(f"{index} names no pipeline class (_class_name)")
    return family_of_pipeline_class(class_name)


__all__ = ["FAMILIES", "Family", "detect_family", "family_named", "family_of_pipeline_class"]
