"""The public surface: what ``mogradient`` and its subpackages export resolves, a harmonizer
can be written against ``mogradient.harmonizers`` alone, and each method has one import path
(its implementation module is private)."""

from __future__ import annotations

import importlib.resources
import re
from pathlib import Path

import torch

import mogradient
import mogradient.engines
import mogradient.harmonizers
import mogradient.qp
import mogradient.scalarizations
from mogradient.harmonizers import CosineGram, Harmonizer, WeighResult

SUBPACKAGES = (
    mogradient.harmonizers,
    mogradient.scalarizations,
    mogradient.engines,
    mogradient.qp,
)


def test_every_exported_name_resolves() -> None:
    for module in (mogradient, *SUBPACKAGES):
        missing = [name for name in module.__all__ if not hasattr(module, name)]
        assert not missing, f"{module.__name__}.__all__ names what it lacks: {missing}"


def test_each_method_has_one_public_import_path() -> None:
    """A registered method is exported by its subpackage, from a private file, not also at
    the top level (which holds the training loop's names only)."""
    for package, registry in (
        (mogradient.harmonizers, mogradient.HARMONIZERS),
        (mogradient.scalarizations, mogradient.SCALARIZATIONS),
    ):
        for name in registry:
            cls = registry[name]
            assert cls.__module__.rsplit(".", 1)[-1].startswith("_"), (name, cls.__module__)
            assert getattr(package, cls.__name__) is cls, name
            assert cls.__name__ not in mogradient.__all__, f"{cls.__name__} is also top-level"
    assert len(mogradient.__all__) <= 25


class _FirstOnly(Harmonizer):
    """All weight on the first usable objective: the smallest custom method."""

    def weigh(self, gram: CosineGram, objectives: torch.Tensor) -> WeighResult:
        weights = torch.zeros(len(gram), dtype=torch.float64)
        weights[0] = 1.0
        return WeighResult(weights)


def test_a_custom_harmonizer_needs_only_the_harmonizers_package() -> None:
    stack = torch.tensor([[0.0, 0.0], [3.0, 4.0], [1.0, -1.0]])
    result = _FirstOnly()(stack)
    assert result.dropped == (0,)
    torch.testing.assert_close(result.weights, torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(result.direction, stack[1])


def test_the_package_ships_its_type_hints() -> None:
    assert importlib.resources.files("mogradient").joinpath("py.typed").is_file()
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert re.search(r'^mogradient = \[.*"py\.typed".*\]$', pyproject, re.MULTILINE)
