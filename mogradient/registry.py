"""Names to things: the one registry behind every extension point.

Harmonizers, scalarizations, rewards, objectives, model families and strategies are all
chosen by name from a config, so they share one mechanism: an entry is registered under
a canonical name (lower snake case) with optional aliases (old spellings keep working),
either as the thing itself or as ``"module:attribute"``, imported on first use so that a
heavy dependency loads only when chosen. An unknown name fails with the choices and the
closest matches. [`import_user_modules`][mogradient.registry.import_user_modules] imports a user's
own modules, whose registrations then join the built-in ones.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Generic, TypeVar

T = TypeVar("T")
C = TypeVar("C")

_CANONICAL = re.compile(r"[a-z][a-z0-9]*(_[a-z0-9]+)*")


class UnknownNameError(KeyError, ValueError):
    """A name no registry entry or alias answers to (a KeyError and a ValueError, so
    callers that caught either before keep working)."""

    def __str__(self) -> str:
        return str(self.args[0])


def normalize(name: str) -> str:
    """The lookup key of a name as a user may write it: ``Nash-MTL`` -> ``nash_mtl``."""
    return name.strip().lower().replace("-", "_").replace(" ", "_")


class Registry(Mapping[str, T], Generic[T]):
    """Canonical name -> entry, with aliases and lazy ``"module:attribute"`` entries.

    A read-only mapping over the canonical names (iteration gives each entry once, in
    registration order); lookups also accept aliases and any case or hyphenation.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind  # "harmonizer", "reward", ...: what error messages call an entry
        self._entries: dict[str, T | str] = {}
        self._aliases: dict[str, str] = {}

    def add(self, name: str, entry: T | str, aliases: Iterable[str] = ()) -> None:
        """Register ``entry`` (or ``"module:attribute"``) as ``name``; old spellings as
        ``aliases``. Registering the same entry twice is harmless; another entry under a
        taken name is refused."""
        if not _CANONICAL.fullmatch(name):
            raise ValueError(
                f"{self.kind} name {name!r} is not lower snake case (letters, digits, "
                "single underscores between words, e.g. 'nash_mtl')"
            )
        if name in self._aliases:
            raise ValueError(
                f"{self.kind} name {name!r} is already an alias of {self._aliases[name]!r}"
            )
        existing = self._entries.get(name, entry)
        if existing is not entry and not _lazy_form_of(existing, entry):
            raise ValueError(f"{self.kind} name {name!r} is already taken by {existing!r}")
        self._entries[name] = entry
        for alias in aliases:
            key = normalize(alias)
            owner = self._aliases.get(key, key if key in self._entries else None)
            if owner not in (None, name):
                raise ValueError(f"{self.kind} alias {alias!r} already names {owner!r}")
            self._aliases[key] = name

    def register(self, name: str | None = None, aliases: Iterable[str] = ()) -> Callable[[C], C]:
        """Class decorator: register the class as ``name`` (default: its ``name`` attribute)."""

        def decorate(cls: C) -> C:
            chosen = name if name is not None else getattr(cls, "name", None)
            if not isinstance(chosen, str) or not chosen:
                raise TypeError(
                    f"{getattr(cls, '__qualname__', cls)!r} has no `name` to register it by: "
                    f"give it a class attribute such as name = 'my_{self.kind}'"
                )
            self.add(chosen, cls, aliases)  # type: ignore[arg-type]
            return cls

        return decorate

    def canonical(self, name: str) -> str:
        """The canonical name ``name`` stands for; UnknownNameError with the choices."""
        key = normalize(name)
        if key in self._entries:
            return key
        if key in self._aliases:
            return self._aliases[key]
        raise UnknownNameError(self._unknown(name, key))

    def __getitem__(self, name: str) -> T:
        canonical = self.canonical(name)
        entry = self._entries[canonical]
        if isinstance(entry, str):
            entry = self._entries[canonical] = _load(entry, self.kind, canonical)
        return entry

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        key = normalize(name)
        return key in self._entries or key in self._aliases

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """Undo every registration made inside the block on leaving it (for tests and
        examples that register throwaway entries in a process that goes on)."""
        entries, aliases = dict(self._entries), dict(self._aliases)
        try:
            yield
        finally:
            self._entries, self._aliases = entries, aliases

    def aliases(self) -> dict[str, str]:
        """Old spelling -> canonical name."""
        return dict(self._aliases)

    def _unknown(self, name: str, key: str) -> str:
        suggestion = did_you_mean(key, [*self._entries, *self._aliases])
        choices = ", ".join(sorted(self._entries))
        return f"unknown {self.kind} {name!r}{suggestion}; choose one of: {choices}"


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'a' or 'b'?)`` with the closest of ``choices``, or ``""``: the hint
    every unknown-name error of the project ends with."""
    close = difflib.get_close_matches(name, list(choices), n=3)
    return f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""


def _lazy_form_of(lazy: object, entry: object) -> bool:
    """Whether ``lazy`` is the ``"module:attribute"`` string that names ``entry``: the
    module that defines a lazily registered class may register it again on import."""
    module, qualname = getattr(entry, "__module__", None), getattr(entry, "__qualname__", None)
    return isinstance(lazy, str) and lazy == f"{module}:{qualname}"


def _load(target: str, kind: str, name: str) -> Any:
    """The attribute a lazy ``"module:attribute"`` entry points at."""
    module_name, _, attribute = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise
        raise UnknownNameError(
            f"{kind} {name!r} is registered but its module {module_name} is not installed"
        ) from None
    return getattr(module, attribute)


def import_user_modules(modules: Iterable[str], purpose: str) -> None:
    """Import the user's modules (dotted names) so their registrations take effect.

    A module in the working directory imports as it would under ``python -m`` (the folder
    is searched after the installed packages, so it shadows none of them). ``purpose``
    names what they are for in the error, e.g. "reward_modules".
    """
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.append(here)
    for module in modules:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as error:
            if error.name is None or not module.startswith(error.name):
                raise
            raise ModuleNotFoundError(
                f"{purpose}: cannot import {module!r} ({error}). The module must be importable "
                f"by Python: installed, or a file in the folder you run from ({here}), or on "
                "PYTHONPATH (a file my_rewards.py is the module 'my_rewards')",
                name=error.name,
            ) from None
