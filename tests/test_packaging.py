"""Two distributions from one repository: the core needs torch and numpy only, the
diffusion package depends on the core, and each wheel holds its own package alone."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent


def _project(path: Path) -> dict:
    return tomllib.loads(path.read_text())["project"]


def _requirement_names(project: dict) -> set[str]:
    return {
        requirement.split(">")[0].split("=")[0].split("<")[0].strip()
        for requirement in project["dependencies"]
    }


def test_the_core_requires_torch_and_numpy_only() -> None:
    assert _requirement_names(_project(ROOT / "pyproject.toml")) == {"torch", "numpy"}


def test_the_diffusion_distribution_requires_the_core() -> None:
    project = _project(ROOT / "diffusion" / "pyproject.toml")
    assert project["name"] == "mogradient-diffusion"
    assert "mogradient" in _requirement_names(project)


def test_importing_the_core_loads_no_optional_dependency() -> None:
    heavy = ("scipy", "matplotlib", "cvxpy", "qpsolvers", "yaml", "diffusers", "transformers")
    code = (
        "import sys, mogradient, mogradient.harmonizers, mogradient.engines, mogradient.qp\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(heavy)!r}))\n"
        "print('mogradient_diffusion' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.split("\n")[:2] == ["[]", "False"], result.stdout


# What each distribution's build reads: built from a copy, so that setuptools' build/ and
# egg-info folders land in a temporary folder, not in the checkout.
SOURCES = {
    "mogradient": ("pyproject.toml", "README.md", "mogradient"),
    "mogradient_diffusion": ("diffusion",),
}


@pytest.mark.slow
@pytest.mark.parametrize("package", sorted(SOURCES))
def test_each_wheel_holds_its_own_package_alone(tmp_path: Path, package: str) -> None:
    source = tmp_path / "source"
    source.mkdir()
    skip = shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
    for name in SOURCES[package]:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=skip)
        else:
            shutil.copy2(ROOT / name, source / name)
    project = source / ("diffusion" if package == "mogradient_diffusion" else "")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--quiet",
            "-w",
            str(tmp_path / "wheels"),
            str(project),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "wheels").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(name.startswith(f"{package}/") for name in names)
    tops = {
        name.split("/")[0]
        for name in names
        if not name.split("/")[0].endswith((".dist-info", ".data"))
    }
    assert tops == {package}, tops
