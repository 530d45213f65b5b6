"""Loading a saved diffusers pipeline of any supported family, with one clear error when
the directory or hub id is not a usable pipeline."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from mogradient_diffusion.model.families import Family, detect_family, family_named

AUTO = "auto"  # model.family: read it from the pipeline's model_index.json


def pipeline_family(path: str | os.PathLike, family: str = AUTO) -> Family:
    """The family of the pipeline at ``path``, known before it loads (a run's config is
    resolved and checked first): ``family`` by name, or the class its model_index.json
    names; for a hub id only that file is fetched."""
    local = _is_local(path)
    if local:
        _check_pipeline_dir(Path(path).expanduser())
    if family != AUTO:
        return family_named(family)
    if local:
        return detect_family(Path(path).expanduser())
    from huggingface_hub import hf_hub_download

    try:
        index = Path(hf_hub_download(str(path), "model_index.json"))
    except (OSError, ValueError) as error:
        raise _not_loadable(path, error) from error
    return detect_family(index.parent)


def load_pipeline(
    path: str | os.PathLike, dtype: torch.dtype, family: str = AUTO
) -> tuple[Any, Family]:
    """The pipeline at ``path`` (a local directory, or a hub id unless ``HF_HUB_OFFLINE``) and
    its family: ``family`` by name, or detected from the pipeline's class."""
    chosen = pipeline_family(path, family)
    local = _is_local(path)
    if local:
        path = Path(path).expanduser()
    try:
        with warnings.catch_warnings():  # newer diffusers renamed torch_dtype to dtype
            warnings.filterwarnings("ignore", message=".*torch_dtype.*", category=FutureWarning)
            return chosen.pipeline_class().from_pretrained(path, torch_dtype=dtype), chosen
    except (OSError, ValueError) as error:
        if local:
            raise
        raise _not_loadable(path, error) from error


def _not_loadable(path: str | os.PathLike, error: Exception) -> FileNotFoundError:
    """One message for a hub id that could not be fetched (offline, unknown, no access)."""
    from huggingface_hub import constants

    offline = " (HF_HUB_OFFLINE is set: only the local cache was tried)"
    return FileNotFoundError(
        f"{str(path)!r} is not a local directory and could not be loaded as a hub model"
        f"{offline if constants.HF_HUB_OFFLINE else ''}: {error}"
    )


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


__all__ = ["AUTO", "load_pipeline", "pipeline_family"]
