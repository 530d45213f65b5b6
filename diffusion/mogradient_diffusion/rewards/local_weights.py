"""Model-based rewards load from local directories: one clear error when files are missing.

Model hubs are often unreachable from training nodes (and always from ours), so every
model-based reward takes a directory path and loads with ``local_files_only=True``. A
missing or incomplete directory raises
[`MissingWeightsError`][mogradient_diffusion.rewards.local_weights.MissingWeightsError] naming the
reward, the files it expected and where the user gets them, instead of a hub traceback.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path


class MissingWeightsError(FileNotFoundError):
    """A model-based reward's local weights are missing; the message says how to get them."""


def require_files(
    reward: str,
    directory: str | os.PathLike | None,
    expected: Sequence[str | tuple[str, ...]],
    how_to_get: str,
) -> Path:
    """Return ``directory`` as a Path after checking it holds every ``expected`` file.

    An entry of ``expected`` that is a tuple is satisfied by any one of its names (e.g.
    ``("model.safetensors", "pytorch_model.bin")``).
    """
    if directory is None:
        raise MissingWeightsError(
            f"reward {reward!r} needs its weights: set the reward option `path` to a local "
            f"directory holding {_describe(expected)}. {how_to_get}"
        )
    path = Path(directory).expanduser()
    if not path.is_dir():
        raise MissingWeightsError(
            f"reward {reward!r}: weights directory {str(path)!r} does not exist. "
            f"It should hold {_describe(expected)}. {how_to_get}"
        )
    missing = [
        " or ".join(names)
        for names in (_alternatives(entry) for entry in expected)
        if not any((path / name).exists() for name in names)
    ]
    if missing:
        raise MissingWeightsError(
            f"reward {reward!r}: {str(path)!r} lacks {', '.join(missing)}. {how_to_get}"
        )
    return path


def _alternatives(entry: str | tuple[str, ...]) -> tuple[str, ...]:
    return (entry,) if isinstance(entry, str) else entry


def _describe(expected: Sequence[str | tuple[str, ...]]) -> str:
    return ", ".join(" or ".join(_alternatives(entry)) for entry in expected)


# What `save_pretrained` writes for a transformers model with its processor.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt")
