"""Loading a saved diffusers pipeline of any supported family, with one clear error when
the directory or hub id is not a usable pipeline."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from mogradient_diffusion.model.families import (
    Family,
    detect_family,
    family_named,
    family_of_pipeline_class,
)

AUTO = "auto"  # model.family: read it from the pipeline's model_index.json


def load_pipeline(
    path: str | os.PathLike, dtype: torch.dtype, family: str = AUTO
) -> tuple[Any, Family]:
    """The pipeline at ``path`` (a local directory, or a hub id unless ``HF_HUB_OFFLINE``) and
    its family: ``family`` by name, or detected from the pipeline's class."""
    local = _is_local(path)
    chosen = None if family == AUTO else family_named(family)
    if local:
        path = Path(path).expanduser()
        _check_pipeline_dir(path)
        if chosen is None:
            chosen = detect_family(path)
    try:
        with warnings.catch_warnings():  # newer diffusers renamed torch_dtype to dtype
            warnings.filterwarnings("ignore", message=".*torch_dtype.*", category=FutureWarning)
            if chosen is None:
                from diffusers import DiffusionPipeline

                pipeline = DiffusionPipeline.from_pretrained(path, torch_dtype=dtype)
                return pipeline, family_of_pipeline_class(type(pipeline).__name__)
            return chosen.pipeline_class().from_pretrained(path, torch_dtype=dtype), chosen
    except (OSError, ValueError) as error:
        if local:
            raise
        from huggingface_hub import constants

        offline = " (HF_HUB_OFFLINE is set: only the local cache was tried)"
        raise FileNotFoundError(
            f"{str(path)!r} is not a local directory and could not be loaded as a hub model"
            f"{offline if constants.HF_HUB_OFFLINE else ''}: {error}"
        ) from error


def _is_local(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a filesystem location rather than an ``owner/name`` hub id."""
    text = str(path)
    return (
        Path(text).expanduser().exists()
        or os.path.isabs(text)
        or text.startswith((".", "~"))
        or text.count("/") != 1
    )


def _check_pipeline_dir(path: Path) -> None:
    """Raise FileNotFoundError naming everything a ``save_pretrained`` layout lacks."""
    index = path / "model_index.json"
    if not path.is_dir():
        raise FileNotFoundError(f"pipeline directory {str(path)!r} does not exist")
    if not index.is_file():
        raise FileNotFoundError(
            f"{str(path)!r} is not a diffusers pipeline directory: missing model_index.json"
        )
    components = json.loads(index.read_text())
    missing = [
        f"{name}/"
        for name, entry in components.items()
        if not name.startswith("_")
        and isinstance(entry, list)
        and entry[0] is not None
        and not (path / name).is_dir()
    ]
    if missing:
        raise FileNotFoundError(
            f"pipeline directory {str(path)!r} is incomplete: missing {', '.join(missing)}"
        )


__all__ = ["AUTO", "load_pipeline"]
