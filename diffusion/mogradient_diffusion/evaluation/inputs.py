"""What ``eval`` checks before any model loads, and the defaults it takes from a run.

Loading SD3 takes minutes on real weights, so a missing or damaged LoRA, an output path
that is a file or a device that does not exist is reported first, as one line. A LoRA
inside a run directory (``<run>/lora``, ``<run>/lora_ema``) brings the run's settings:
its model, sampling steps, resolution, guidance, sequence length and dtype, unless the
command line says otherwise; so does a ``--model`` that names a run directory (or the tiny
model saved in one), for the run's base model: both evaluations then match for ``compare``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import yaml

from mogradient_diffusion.config.devices import parse_device

LORA_FILE = "pytorch_lora_weights.safetensors"
TRANSFORMER_PREFIX = "transformer."

# EvalSettings field -> (section, key) of a run's config.yaml.
RUN_SETTINGS = {
    "steps": ("rollout", "steps"),
    "guidance_scale": ("rollout", "guidance_scale"),
    "guidance": ("model", "guidance"),
    "resolution": ("rollout", "resolution"),
    "max_sequence_length": ("rollout", "max_sequence_length"),
    "dtype": ("model", "dtype"),
}


def check_lora(lora: str) -> list[str]:
    """The transformer LoRA keys of ``lora``'s weights file, read from its header only.

    Raises FileNotFoundError / ValueError naming the fix for a missing folder or file, a
    truncated file, or one without SD3 transformer weights (a LoRA of another model).
    """
    directory = Path(lora).expanduser()
    if not directory.is_dir():
        raise FileNotFoundError(
            f"--lora {lora!r} is not a directory; give a run's lora/ or lora_ema/"
        )
    weights = directory / LORA_FILE
    if not weights.is_file():
        raise FileNotFoundError(f"--lora {lora!r} has no {LORA_FILE}{_run_hint(directory)}")
    keys = [key for key in _safetensors_keys(weights) if key.startswith(TRANSFORMER_PREFIX)]
    if not keys:
        raise ValueError(
            f"{weights} holds no SD3 transformer LoRA weights (no key starts with "
            f"{TRANSFORMER_PREFIX!r}): is it a LoRA of another kind of model?"
        )
    return keys


def _run_hint(directory: Path) -> str:
    """Point at the LoRA folders when ``--lora`` was given the run directory itself."""
    found = [str(directory / name) for name in ("lora", "lora_ema") if (directory / name).is_dir()]
    return f" (it looks like a run directory: use {' or '.join(found)})" if found else ""


def _safetensors_keys(path: Path) -> list[str]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as handle:
            return list(handle.keys())
    except (SafetensorError, OSError) as error:
        raise ValueError(
            f"{path} is not a readable safetensors file ({error}); it may be truncated: "
            "copy it again or re-export the LoRA"
        ) from None


def resolve_device(name: str) -> torch.device:
    """``auto``: the first GPU if there is one, else the CPU; a bare ``cuda`` is ``cuda:0``.

    ValueError for a name that is no device or a GPU this machine does not have.
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = parse_device(name, "--device")
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", 0)
    return device


def check_output_dir(out: str) -> Path:
    """``out`` as a path; ValueError when it names an existing file (it must be a folder)
    or a place this user cannot write to (found now, not after the images are made)."""
    path = Path(out).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {out!r} is an existing file; give a folder for the evaluation")
    existing = next(folder for folder in (path, *path.absolute().parents) if folder.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out!r}: {existing} is not a folder this user can write to")
    return path


def run_defaults(lora: str | None, model: str | None = None) -> tuple[Path | None, dict[str, Any]]:
    """``(config.yaml, settings)`` of the run ``lora`` belongs to, or without a LoRA of
    the run ``model`` names (``run_of_model``), or ``(None, {})``.

    The settings are EvalSettings fields (``model`` among them): evaluating a LoRA with
    the steps, resolution and sequence length it was trained with, and its base model as
    the run sampled it, is what a user means unless a flag says otherwise.
    """
    if lora is not None:
        config_path = Path(lora).expanduser().parent / "config.yaml"
    elif model is not None:
        config_path = run_of_model(Path(model).expanduser()) / "config.yaml"
    else:
        return None, {}
    if not config_path.is_file():
        return None, {}
    config = _read_run_config(config_path)
    values = {
        field: _section(config, section).get(key) for field, (section, key) in RUN_SETTINGS.items()
    }
    values["model"] = _run_model(config, config_path.parent)
    return config_path, {key: value for key, value in values.items() if value is not None}


def run_of_model(model: Path) -> Path:
    """The run directory ``--model`` names: the folder itself when it is a run (a
    ``config.yaml``, no ``model_index.json``), the run around it when it is a run's
    ``tiny_model/``; else ``model`` (which then has no run config)."""
    if (model / "config.yaml").is_file() and not (model / "model_index.json").is_file():
        return model
    return model.parent if model.name == "tiny_model" else model


def _read_run_config(path: Path) -> dict[str, Any]:
    try:
        config = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} (the LoRA's run config) is not valid YAML: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} (the LoRA's run config) does not hold a mapping")
    return config


def _section(config: dict[str, Any], name: str) -> dict[str, Any]:
    section = config.get(name)
    return section if isinstance(section, dict) else {}


def _run_model(config: dict[str, Any], run_dir: Path) -> str | None:
    """The run's ``model.path``; a tiny-preset run (no path) saved its model in the run."""
    path = _section(config, "model").get("path")
    if path is not None:
        return str(path)
    tiny = run_dir / "tiny_model"
    return str(tiny) if (tiny / "model_index.json").is_file() else None
