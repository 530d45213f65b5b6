"""The public surface: what ``mogradient`` exports resolves, and a harmonizer can be written
against it alone (its internals are private modules)."""

from __future__ import annotations

import importlib.resources
import re
from pathlib import Path

import torch

import mogradient
import mogradient.harmonizers


def test_every_exported_name_resolves() -> None:
    for module in (mogradient, mogradient.harmonizers):
        missing = [name for name in module.__all__ if not hasattr(module, name)]
        assert not missing, f"{module.__name__}.__all__ names what it lacks: {missing}"


class _FirstOnly(mogradient.Harmonizer):
    """All weight on the first usable objective: the smallest custom method."""

    def weigh(
        self, gram: mogradient.CosineGram, objectives: torch.Tensor
    ) -> mogradient.WeighResult:
        weights = torch.zeros(len(gram), dtype=torch.float64)
        weights[0] = 1.0
        return mogradient.WeighResult(weights)


def test_a_custom_harmonizer_needs_only_the_top_level_names() -> None:
    stack = torch.tensor([[0.0, 0.0], [3.0, 4.0], [1.0, -1.0]])
    result = _FirstOnly()(stack)
    assert result.dropped == (0,)
    torch.testing.assert_close(result.weights, torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(result.direction, stack[1])


def test_the_package_ships_its_type_hints() -> None:
    assert importlib.resources.files("mogradient").joinpath("py.typed").is_file()
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert re.search(r'^mogradient = \[.*"py\.typed".*\]$', pyproject, re.MULTILINE)
