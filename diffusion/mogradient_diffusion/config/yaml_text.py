"""YAML read within bounds, so that a file which is no config fails in one line.

A config is a few kilobytes and a few hundred values. PyYAML shares an anchored value
among its aliases, so a 500-byte "billion laughs" document loads at once and only blows
up later, when the config is copied and saved (minutes, and a config.yaml of hundreds of
megabytes); an alias may even sit inside the value it names, a loop that no copy ends.
Both are refused here, before anything is built from the document, as are binary files
and YAML errors, whose own messages span several lines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

MAX_BYTES = 1_000_000
# Values (mappings, lists, scalars, keys) after every alias is expanded: the presets and
# shipped recipes hold under 200.
MAX_VALUES = 100_000
# Levels of nested mappings and lists: a config has 4; saving one nested hundreds deep
# would exhaust Python's recursion limit.
MAX_DEPTH = 50
_TOO_DEEP = f"nested more than {MAX_DEPTH} levels deep, unlike a config; is it the right file?"


class YamlProblem(ValueError):
    """Why a text is not a config's YAML, as a predicate: "not valid YAML: ...".

    The caller names the file or override it came from (``f"{path} is {problem}"``).
    """


def read_yaml(path: Path) -> Any:
    """The YAML document in ``path`` (None when empty); YamlProblem when it is no config."""
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_BYTES + 1)
    except OSError as error:
        raise YamlProblem(f"unreadable ({error.strerror or error})") from None
    if len(data) > MAX_BYTES:
        raise YamlProblem(
            f"too big: more than {MAX_BYTES} bytes, far more than a config; is it the right file?"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise YamlProblem(
            f"not UTF-8 text (byte {data[error.start]:#04x} at offset {error.start}): "
            "a config is a YAML text file; is it the right file?"
        ) from None
    return parse_yaml(text)


def parse_yaml(text: str) -> Any:
    """``yaml.safe_load(text)``, refused in one line when invalid, cyclic or too large."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_size(node)
        return loader.construct_document(node)
    except yaml.YAMLError as error:
        raise YamlProblem(f"not valid YAML: {_one_line(error)}") from None
    except RecursionError:  # PyYAML composes nested values recursively
        raise YamlProblem(_TOO_DEEP) from None
    finally:
        loader.dispose()


def _one_line(error: yaml.YAMLError) -> str:
    """PyYAML's problem and where it is, without the multi-line excerpt of the text."""
    if isinstance(error, yaml.MarkedYAMLError) and error.problem:
        mark = error.problem_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        return f"{error.problem}{where}"
    return " ".join(str(error).split())


def _check_size(root: yaml.Node) -> None:
    """Count the values of the document as if every alias were written out, in time linear
    in the nodes PyYAML composed (an aliased node is counted once, then reused)."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()  # on the path from the root: an alias to one is a loop
    stack: list[tuple[yaml.Node, bool, int]] = [(root, False, 0)]
    while stack:
        node, children_done, depth = stack.pop()
        key = id(node)
        if children_done:
            open_nodes.discard(key)
            sizes[key] = 1 + sum(sizes[id(child)] for child in _children(node))
            if sizes[key] > MAX_VALUES:
                raise YamlProblem(
                    f"too big: more than {MAX_VALUES} values once its YAML aliases (*name) "
                    "are expanded, far more than a config holds; write the values out, or "
                    "use fewer aliases"
                )
        elif key in open_nodes:
            raise YamlProblem(
                "not a config: a YAML alias (*name) sits inside the value it names, a loop "
                "with no end; write the values out"
            )
        elif depth > MAX_DEPTH:
            raise YamlProblem(_TOO_DEEP)
        elif key not in sizes:
            open_nodes.add(key)
            stack.append((node, True, depth))
            stack.extend((child, False, depth + 1) for child in _children(node))


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []
