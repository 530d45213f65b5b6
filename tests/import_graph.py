"""The project's import graph, read from the source (AST), for the import-cycle and
layering tests.

Every import counts: at module level, inside functions (lazy imports) and under
``TYPE_CHECKING``, because each is a dependency a reader has to follow.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# package -> the folder it is imported from (the diffusion distribution lives in diffusion/)
PACKAGES = {
    "mogradient": ROOT,
    "mogradient_diffusion": ROOT / "diffusion",
    "miniature": ROOT,
    "benchmarks": ROOT,
    "tools": ROOT,
}


def modules() -> dict[str, Path]:
    """Dotted name -> file of every Python module in the project's packages."""
    found = {}
    for package, home in PACKAGES.items():
        for path in sorted((home / package).rglob("*.py")):
            parts = path.relative_to(home).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules that ``name`` (at ``path``) imports anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            candidates = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in known:
                candidate = candidate.rpartition(".")[0]
            if candidate and candidate != name:
                targets.add(candidate)
                break
    return targets


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports."""
    known = modules()
    return {name: imported(name, path, known) for name, path in known.items()}
