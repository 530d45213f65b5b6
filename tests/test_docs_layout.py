"""docs/layout.md is the map of the code: it names every module, and nothing that is gone.

Each package has its own section (a heading naming the package in backticks); in it every
module file and sub-folder of that package must appear, and every ``name.py`` the section
mentions must exist in the package.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYOUT = ROOT / "docs" / "layout.md"
# package -> its folder
PACKAGES = {
    "mogradient": ROOT / "mogradient",
    "mogradient_diffusion": ROOT / "diffusion" / "mogradient_diffusion",
    "miniature": ROOT / "miniature",
}


def _sections(text: str) -> dict[str, str]:
    """Heading's package name -> the section's text (up to the next ## heading)."""
    found = {}
    for part in re.split(r"^## ", text, flags=re.M)[1:]:
        match = re.match(r"`([a-z_]+)`", part)
        if match:
            found[match.group(1)] = part
    return found


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_the_layout_names_every_module_and_no_missing_one(package: str) -> None:
    folder = PACKAGES[package]
    section = _sections(LAYOUT.read_text()).get(package)
    assert section is not None, f"docs/layout.md has no '## `{package}`' section"
    files = {p for p in folder.rglob("*.py") if p.name != "__init__.py"}
    unnamed = sorted(
        str(p.relative_to(folder))
        for p in files
        if not re.search(rf"\b{re.escape(p.name)}\b", section)
    )
    folders = {p.parent.relative_to(folder) for p in files} - {Path(".")}
    unnamed += sorted(f"{f}/" for f in folders if f"{f.name}/" not in section)
    assert not unnamed, f"docs/layout.md's {package} section does not name: {unnamed}"
    existing = {p.name for p in files} | {"__init__.py"}
    stale = sorted(set(re.findall(r"\b(\w+\.py)\b", section)) - existing)
    assert not stale, f"docs/layout.md's {package} section names modules that do not exist: {stale}"
