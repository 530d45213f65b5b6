"""The ```python blocks of README.md and docs/**/*.md run as they stand.

Each block is one test: it runs on its own in a fresh namespace (blocks of a page do not
share names, so every block carries its own imports), with the working directory a
temporary folder, and fails the test if it raises. Blocks in other languages (```bash,
```yaml) are not run.

A block that cannot run here (SD3.5 weights, a GPU, torchrun, or an excerpt of a file that
another test runs) is marked on the line just before its opening fence with a visible
reason, and is reported as skipped with it:

    <!-- not-run: needs an SD3.5-Medium pipeline on disk -->
    ```python

An unmarked block that raises fails; a marker without a reason, or one that is not followed
by a python block, fails too (docs/development.md describes the convention).
"""

from __future__ import annotations

import contextlib
import os
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`\n]*)$")
NOT_RUN = re.compile(r"^\s*<!--\s*not-run:(?P<reason>.*?)-->\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    source: str
    not_run: str | None  # the reason, when marked

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _blocks(page: Path) -> list[Block]:
    """Every fenced python block of ``page``, with the not-run reason marked before it."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks, index = [], 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        fence, indent = opening["fence"], opening["indent"]
        language = opening["info"].strip().split(" ")[0].lower()
        end = index + 1
        while end < len(lines) and not re.match(
            rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[end]
        ):
            end += 1
        if language in ("python", "py"):
            body = [line.removeprefix(indent) for line in lines[index + 1 : end]]
            marker = NOT_RUN.match(lines[index - 1]) if index > 0 else None
            reason = marker["reason"].strip() if marker else None
            blocks.append(Block(page, index + 1, textwrap.dedent("\n".join(body)), reason))
        index = end + 1
    return blocks


BLOCKS = [block for page in PAGES for block in _blocks(page)]


def _registries() -> list:
    """Every registry a docs block may add to (Extending registers throwaway entries)."""
    from mogradient import HARMONIZERS, SCALARIZATIONS
    from mogradient_diffusion.evaluation.evaluate import PROMPT_SETS
    from mogradient_diffusion.model.families import FAMILIES
    from mogradient_diffusion.objectives import OBJECTIVES
    from mogradient_diffusion.rewards import REWARDS
    from mogradient_diffusion.runs.loggers import LOGGERS
    from mogradient_diffusion.strategies import STRATEGIES

    registries = [HARMONIZERS, SCALARIZATIONS, PROMPT_SETS, FAMILIES, OBJECTIVES, REWARDS]
    return [*registries, STRATEGIES, LOGGERS]


def test_the_pages_have_python_blocks_and_every_marker_names_a_reason() -> None:
    assert len(BLOCKS) >= 5, [block.name for block in BLOCKS]
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines, start=1):
            marker = NOT_RUN.match(line)
            if marker is None:
                continue
            where = f"{page.relative_to(ROOT)}:{number}"
            assert marker["reason"].strip(), f"{where}: a not-run marker needs a reason"
            following = lines[number] if number < len(lines) else ""
            assert re.match(r"^\s*(`{3,}|~{3,})\s*(python|py)\b", following), (
                f"{where}: a not-run marker must sit on the line just before a python fence"
            )


@pytest.mark.parametrize("block", BLOCKS, ids=[block.name for block in BLOCKS])
def test_code_block_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if block.not_run is not None:
        pytest.skip(f"not-run: {block.not_run}")
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__docs__", "__file__": str(tmp_path / "block.py")}
    # dont_inherit: the block runs as a user runs it, without this file's __future__ imports
    code = compile(block.source, block.name, "exec", dont_inherit=True)
    threads = torch.get_num_threads()
    generator_state = torch.random.get_rng_state()
    try:
        with contextlib.ExitStack() as registrations:  # a block's registrations end with it
            for registry in _registries():
                registrations.enter_context(registry.restored())
            exec(code, namespace)
    finally:
        torch.set_num_threads(threads)
        torch.random.set_rng_state(generator_state)
    assert os.getcwd() == str(tmp_path)
