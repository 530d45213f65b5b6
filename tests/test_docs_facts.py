"""The counts and headline numbers the home page and README.md state are the code's and the
results' own.

The home page (docs/index.md) and README.md say how many harmonizers, scalarizations,
rewards, strategies, objectives and model families there are ("22 harmonizers"); each such
count is read from the page and compared with the registry it counts, so adding a method
without updating the pages fails here. The home page's multi-task headline quotes Δm% values
of docs/mtl.md's scaled-tasks table; they are compared with that table.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INDEX = ROOT / "docs" / "index.md"
README = ROOT / "README.md"
MTL = ROOT / "docs" / "mtl.md"
PACKAGES = ("mogradient.", "mogradient_diffusion.")


def _registries() -> dict[str, int]:
    """Each registry's built-in entries: those the packages define (other tests register
    rewards, strategies, ... of their own in the same process)."""
    from mogradient import HARMONIZERS, SCALARIZATIONS
    from mogradient_diffusion.model.families import FAMILIES
    from mogradient_diffusion.objectives import OBJECTIVES
    from mogradient_diffusion.rewards import REWARDS
    from mogradient_diffusion.strategies import STRATEGIES

    def built_in(registry) -> int:
        def module(entry) -> str:
            return (entry if isinstance(entry, type) else type(entry)).__module__

        return sum(module(registry[name]).startswith(PACKAGES) for name in registry)

    return {
        "harmonizers": built_in(HARMONIZERS),
        "scalarizations": built_in(SCALARIZATIONS),
        "families": built_in(FAMILIES),
        "objectives": built_in(OBJECTIVES),
        "rewards": built_in(REWARDS),
        "strategies": built_in(STRATEGIES),
    }


# what each page states: registry -> the phrase that carries its count
STATED = {
    INDEX: {
        "harmonizers": r"(\d+) harmonizers",
        "scalarizations": r"(\d+) loss-based scalarizations",
        "families": r"(\d+) model families",
        "objectives": r"(\d+) objectives",
        "rewards": r"(\d+) rewards",
        "strategies": r"(\d+) strategies",
    },
    README: {
        "harmonizers": r"(\d+) gradient harmonizers",
        "scalarizations": r"(\d+) loss-based scalarizations",
    },
}
CASES = [(page, registry) for page, phrases in STATED.items() for registry in phrases]


def _stated(page: Path, pattern: str) -> list[int]:
    text = re.sub(r"\s+", " ", page.read_text(encoding="utf-8"))  # phrases may wrap
    return [int(count) for count in re.findall(pattern, text)]


@pytest.mark.parametrize(("page", "registry"), CASES, ids=[f"{p.name}-{r}" for p, r in CASES])
def test_the_stated_count_is_the_registrys(page: Path, registry: str) -> None:
    counts = _stated(page, STATED[page][registry])
    assert counts, f"{page.name} no longer states how many {registry} there are"
    actual = _registries()[registry]
    assert set(counts) == {actual}, f"{page.name} says {counts} {registry}; there are {actual}"


def test_the_home_page_names_every_model_family() -> None:
    from mogradient_diffusion.model.families import FAMILIES

    # registry name -> how the pages spell the family
    spelled = {"sd3": "SD3/SD3.5", "flux": "FLUX.1", "qwen_image": "Qwen-Image"}
    assert set(FAMILIES) == set(spelled), "a family was added: name it on the home page"
    text = INDEX.read_text(encoding="utf-8")
    assert [name for name in spelled.values() if name not in text] == []


def _scaled_tasks_delta_m() -> dict[str, float]:
    """docs/mtl.md's scaled-tasks table: 'method (library)' -> mean Δm%."""
    section = MTL.read_text(encoding="utf-8").split("### scaled-tasks", 1)[1]
    section = section.split("\n### ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 8 and re.match(r"[+-]\d", cells[5]):
            rows[f"{cells[0]} ({cells[1]})"] = float(cells[5].split("±")[0])
    return rows


def test_the_home_pages_multi_task_headline_is_mtl_md_s_table() -> None:
    rows = _scaled_tasks_delta_m()
    text = re.sub(r"\s+", " ", INDEX.read_text(encoding="utf-8"))
    headline = text.split("**Multi-task learning**", 1)[1].split("- **", 1)[0]
    quoted = {
        "FAMO (mogradient)": r"FAMO \(([+-][\d.]+)\)",
        "PCD (mogradient)": r"PCD \(([+-][\d.]+)\)",
        "MGDA (mogradient)": r"plain MGDA \(([+-][\d.]+)",
        "TorchJD MGDA (torchjd)": r"TorchJD's MGDA ([+-][\d.]+)",
        "EW (mogradient)": r"equal weights end at ([+-][\d.]+)",
    }
    for row, pattern in quoted.items():
        match = re.search(pattern, headline)
        assert match, f"the home page's multi-task headline no longer quotes {row}"
        stated = float(match.group(1))
        decimals = len(match.group(1).split(".")[1])
        assert round(rows[row], decimals) == stated, (
            f"the home page says {row} {stated}; docs/mtl.md's table says {rows[row]}"
        )
    # and the best rows it names are the table's best ones
    ranked = sorted(
        (value, name) for name, value in rows.items() if not name.startswith("single-task")
    )
    best = {name.split(" (")[0].removeprefix("TorchJD ") for _, name in ranked[:4]}
    assert best <= {"FAMO", "PCD"}, f"the table's best rows are now {ranked[:4]}"
