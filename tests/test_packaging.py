"""Two distributions from one repository: the core needs torch and numpy only, the
diffusion package depends on the core, and each wheel holds its own package alone."""

from __future__ import annotations

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


@pytest.mark.slow
@pytest.mark.parametrize(
    ("folder", "package", "other"),
    [
        (".", "mogradient", "mogradient_diffusion"),
        ("diffusion", "mogradient_diffusion", "mogradient/"),
    ],
)
def test_each_wheel_holds_its_own_package_alone(
    tmp_path: Path, folder: str, package: str, other: str
) -> None:
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
            str(tmp_path),
            str(ROOT / folder),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(name.startswith(f"{package}/") for name in names)
    tops = {
        name.split("/")[0]
        for name in names
        if not name.split("/")[0].endswith((".dist-info", ".data"))
    }
    assert tops == {package}, tops
