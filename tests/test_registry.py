"""The registry behind every extension point: names, aliases, lazy entries, clear errors."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from mogradient.registry import Registry, UnknownNameError, import_user_modules, normalize


class Widget:
    name = "big_widget"


def test_entries_answer_to_their_name_aliases_any_case_and_hyphenation() -> None:
    registry: Registry[type] = Registry("widget")
    registry.add("big_widget", Widget, aliases=["bigwidget"])
    assert registry["big_widget"] is Widget
    assert registry["BigWidget"] is Widget  # the alias, any case
    assert registry["Big-Widget"] is Widget
    assert registry.canonical("bigwidget") == "big_widget"
    assert list(registry) == ["big_widget"]  # aliases are not iterated
    assert "bigwidget" in registry and "small_widget" not in registry and 3 not in registry
    assert registry.aliases() == {"bigwidget": "big_widget"}
    assert normalize(" Nash-MTL ") == "nash_mtl"


def test_an_unknown_name_names_the_choices_and_the_closest_match() -> None:
    registry: Registry[type] = Registry("widget")
    registry.add("big_widget", Widget)
    registry.add("small_widget", Widget)
    with pytest.raises(UnknownNameError) as caught:
        registry["big_widgte"]
    message = str(caught.value)
    assert "unknown widget 'big_widgte'" in message
    assert "did you mean 'big_widget'" in message
    assert "choose one of: big_widget, small_widget" in message
    assert isinstance(caught.value, KeyError) and isinstance(caught.value, ValueError)


def test_names_are_lower_snake_case_and_taken_names_are_refused() -> None:
    registry: Registry[type] = Registry("widget")
    for bad in ("BigWidget", "big-widget", "big__widget", "_big", "2big", ""):
        with pytest.raises(ValueError, match="lower snake case"):
            registry.add(bad, Widget)
    registry.add("big_widget", Widget, aliases=["bigwidget"])
    registry.add("big_widget", Widget)  # the same entry again: harmless
    with pytest.raises(ValueError, match="already taken"):
        registry.add("big_widget", object)
    with pytest.raises(ValueError, match="already an alias"):
        registry.add("bigwidget", object)
    with pytest.raises(ValueError, match="already names"):
        registry.add("other", object, aliases=["big_widget"])


def test_the_decorator_registers_a_class_by_its_name_attribute() -> None:
    registry: Registry[type] = Registry("widget")
    assert registry.register(aliases=["bw"])(Widget) is Widget
    assert registry["bw"] is Widget

    class Nameless:
        pass

    with pytest.raises(TypeError, match="has no `name`"):
        registry.register()(Nameless)


def test_a_lazy_entry_imports_its_module_on_first_use(tmp_path: Path, monkeypatch) -> None:
    module = tmp_path / "lazy_widget_module.py"
    module.write_text(
        textwrap.dedent(
            """
            IMPORTED = True
            class Lazy:
                name = "lazy"
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    registry: Registry[type] = Registry("widget")
    registry.add("lazy", "lazy_widget_module:Lazy")
    registry.add("gone", "no_such_widget_module:Gone")
    assert "lazy_widget_module" not in sys.modules
    loaded = registry["lazy"]
    assert loaded.__name__ == "Lazy" and "lazy_widget_module" in sys.modules
    registry.add("lazy", loaded)  # the module registering its class again: no conflict
    with pytest.raises(UnknownNameError, match="module no_such_widget_module is not installed"):
        registry["gone"]


def test_a_missing_user_module_says_how_to_make_it_importable() -> None:
    with pytest.raises(ModuleNotFoundError, match=r"PYTHONPATH") as caught:
        import_user_modules(["my_rewards_that_do_not_exist"], "reward_modules")
    assert "reward_modules: cannot import 'my_rewards_that_do_not_exist'" in str(caught.value)


def test_a_module_in_the_working_directory_imports(tmp_path: Path, monkeypatch) -> None:
    """As under ``python -m``: a console script does not put the folder on sys.path."""
    (tmp_path / "working_directory_rewards.py").write_text("LOADED = True\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    import_user_modules(["working_directory_rewards"], "reward_modules")
    assert sys.modules["working_directory_rewards"].LOADED


def test_registrations_inside_restored_are_undone() -> None:
    registry: Registry[type] = Registry("widget")
    registry.add("big_widget", Widget)
    with registry.restored():
        registry.add("throwaway", object, aliases=["thrown"])
        assert "thrown" in registry
    assert list(registry) == ["big_widget"] and "thrown" not in registry
