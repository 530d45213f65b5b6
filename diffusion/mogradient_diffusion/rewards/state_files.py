"""Reading a weights file the user named: one line when it is not one.

The converters take a path typed on the command line. Given the wrong file (a text file,
an archive, random bytes), ``torch.load`` raises whatever its unpickler meets first, a
``KeyError: 101`` or a page-long ``UnpicklingError``; here that is one ValueError naming
the file and what was expected.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor


def load_state_dict(path: Path, expected: str) -> dict[str, Tensor]:
    """The tensors of ``path``: a ``.safetensors`` file, or a torch checkpoint holding them
    bare or under ``state_dict``. ``expected`` names the file the caller wanted."""
    try:
        data = _read(path)
    except OSError:
        raise
    except Exception as error:  # the unpickler's and safetensors' errors have no common base
        raise ValueError(
            f"{path} is not a weights file that PyTorch can load safely "
            f"({type(error).__name__}): expected {expected}"
        ) from None
    state = data.get("state_dict", data) if isinstance(data, dict) else data
    if not _is_state_dict(state):
        raise ValueError(f"{path} holds {_describe(state)}: expected {expected}")
    return state


def _read(path: Path) -> Any:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def _is_state_dict(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and bool(value)
        and all(isinstance(k, str) and isinstance(v, Tensor) for k, v in value.items())
    )


def _describe(value: Any) -> str:
    if isinstance(value, dict) and value:
        return "a mapping whose entries are not all named tensors, not a model's state dict"
    if isinstance(value, dict):
        return "no tensors"
    return f"an object of type {type(value).__name__}, not a model's state dict"
