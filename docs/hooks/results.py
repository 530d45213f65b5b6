"""mkdocs hook: serve the committed benchmark results under ``results/`` of the site.

mkdocs only serves what is under ``docs/``, and the results live in ``benchmarks/results/``
(written there by the benchmarks). Rather than a second copy under ``docs/`` that would
drift, this hook registers every file of ``benchmarks/results/`` with mkdocs as if it were
``docs/results/<same path>``: pages link to ``../results/mini/table.md`` or embed
``../results/mini/curves.png`` and mkdocs validates those links like any other (a missing
file is a warning, so ``--strict`` fails on it).

The result tables (``.md``) are rendered as pages of their own, kept out of the
navigation; the figures, JSON, CSV, logs and environment dumps are copied as they are.
Each folder also gets a generated ``index.md`` listing its files, so that a page can link
to a folder of results (``../results/mtl/index.md``). ``mkdocs serve`` watches the folder.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files, InclusionLevel

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
PREFIX = "results"  # where they appear in the site, relative to docs_dir
SUFFIXES = {".png", ".md", ".json", ".csv", ".txt", ".log"}
HIDDEN = InclusionLevel.NOT_IN_NAV  # built and linkable, but not in the navigation


def _result_files() -> list[Path]:
    """The results to publish, in a stable order."""
    return sorted(path for path in RESULTS.rglob("*") if path.is_file() and path.suffix in SUFFIXES)


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    if RESULTS.is_dir() and str(RESULTS) not in config.watch:
        config.watch.append(str(RESULTS))
    return config


def _listing(folder: Path, paths: list[Path]) -> str:
    """The generated index page of one results folder: its sub-folders and files, linked."""
    relative = folder.relative_to(RESULTS).as_posix()
    title = "benchmarks/results/" + ("" if relative == "." else f"{relative}/")
    lines = [f"# `{title}`", "", "Committed benchmark results, as the benchmarks wrote them.", ""]
    below = sorted({p.relative_to(folder).parts[0] for p in paths if p.parent != folder})
    lines += [f"- [`{name}/`]({name}/index.md)" for name in below]
    lines += [f"- [`{p.name}`]({p.name})" for p in paths if p.parent == folder]
    return "\n".join(lines) + "\n"


def _add(files: Files, file: File) -> None:
    if file.src_uri in files.src_uris:
        raise ValueError(f"docs/{file.src_uri} would shadow benchmarks/results/; remove it")
    files.append(file)


def on_files(files: Files, *, config: MkDocsConfig) -> Files:
    paths = _result_files()
    for path in paths:
        src_uri = f"{PREFIX}/{path.relative_to(RESULTS).as_posix()}"
        _add(files, File.generated(config, src_uri, abs_src_path=str(path), inclusion=HIDDEN))
    folders = {RESULTS} | {parent for path in paths for parent in path.parents}
    for folder in sorted(f for f in folders if f == RESULTS or RESULTS in f.parents):
        inside = [p for p in paths if folder in p.parents]
        relative = folder.relative_to(RESULTS).as_posix()
        src_uri = f"{PREFIX}/index.md" if relative == "." else f"{PREFIX}/{relative}/index.md"
        content = _listing(folder, inside)
        _add(files, File.generated(config, src_uri, content=content, inclusion=HIDDEN))
    return files
