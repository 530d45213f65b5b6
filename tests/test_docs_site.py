"""The documentation site builds with ``mkdocs build --strict``, and --strict does fail.

Two builds (~15-60 s each, most of it rendering the API reference): the real site must
build without a warning; and a copy of the docs with one page carrying a broken link must
fail, naming the link, so that the gate in ``make test`` is known to bite. The planted copy
uses a temporary config file beside mkdocs.yml (same theme, hooks and plugins; relative
paths in it resolve as in the real one) whose docs_dir is a copy of docs/.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BROKEN = "no-such-page.md"

pytestmark = pytest.mark.slow


def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict"]
    command += ["--config-file", str(config), "--site-dir", str(site)]
    return subprocess.run(
        command,
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    result = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    log = result.stdout + result.stderr
    assert "WARNING" not in log, log
    # the hook published the committed results, and pages embed them
    assert (tmp_path / "site" / "results" / "mini" / "curves.png").is_file()
    assert 'src="../results/mini/curves.png"' in (
        tmp_path / "site" / "miniature" / "index.html"
    ).read_text(encoding="utf-8")


def test_a_broken_link_fails_the_strict_build(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    page = docs / "getting-started.md"
    page.write_text(
        page.read_text(encoding="utf-8") + f"\n\nSee [a page that is not there]({BROKEN}).\n",
        encoding="utf-8",
    )
    # beside mkdocs.yml, so that paths.: [., diffusion] and the hooks resolve as in the real one
    config = ROOT / f".mkdocs-planted-{os.getpid()}.yml"
    config.write_text(
        f"INHERIT: mkdocs.yml\ndocs_dir: {docs}\n",
        encoding="utf-8",
    )
    try:
        result = _build(config, tmp_path / "site")
    finally:
        config.unlink()
    log = result.stdout + result.stderr
    assert result.returncode != 0, log
    assert BROKEN in log and "getting-started.md" in log, log
