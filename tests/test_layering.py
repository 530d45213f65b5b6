"""Each layer imports only what sits below it.

Every import counts (``import_graph``): at module level, lazy inside a function, or under
``TYPE_CHECKING``. The rules, bottom up:

- ``mogradient`` (the core, torch + numpy) imports no application: not
  ``mogradient_diffusion``, ``miniature``, ``benchmarks`` or ``tools``;
- ``mogradient_diffusion`` (installed on its own) imports none of the repository-only
  packages ``miniature``, ``benchmarks``, ``tools``;
- ``mogradient_diffusion.config`` (the sections of the settings) and
  ``mogradient_diffusion.advantages`` (tensor maths) import nothing else of the package;
- ``mogradient_diffusion.model`` (the policy and its pipelines) imports, of the package,
  only ``config``: no sampling, no RL (objectives, strategies, advantages, training),
  no rewards, prompts or runs;
- ``mogradient_diffusion.objectives`` imports neither the training loop, nor the
  strategies, nor what sits above both (the loader ``training_config``, ``cli``,
  ``evaluation``);
- ``mogradient_diffusion.strategies`` imports neither the training loop, nor the
  objectives, nor the loader or ``cli``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from import_graph import import_graph, imported, modules

PACKAGE = "mogradient_diffusion"


@dataclass(frozen=True)
class Rule:
    """Modules under ``importer`` import nothing under ``forbidden`` except ``allowed``
    (a module under ``importer`` may always import its neighbours)."""

    importer: str
    forbidden: tuple[str, ...]
    why: str
    allowed: tuple[str, ...] = ()


RULES = (
    Rule(
        "mogradient",
        (PACKAGE, "miniature", "benchmarks", "tools"),
        "the core is torch + numpy and knows no application",
    ),
    Rule(
        PACKAGE,
        ("miniature", "benchmarks", "tools"),
        "the installed package cannot import what only this repository holds",
    ),
    Rule(
        f"{PACKAGE}.config",
        (PACKAGE,),
        "config/ is a leaf room of settings that every part may read",
    ),
    Rule(f"{PACKAGE}.advantages", (PACKAGE,), "advantages are tensor maths below RL"),
    Rule(
        f"{PACKAGE}.model",
        (PACKAGE,),
        "the model (policy, pipelines) sits below sampling and RL",
        allowed=(f"{PACKAGE}.config",),
    ),
    Rule(
        f"{PACKAGE}.objectives",
        tuple(
            f"{PACKAGE}.{name}"
            for name in ("training", "strategies", "training_config", "cli", "evaluation")
        ),
        "an objective turns rewards into advantages and losses, below the loop and the "
        "strategies that weigh them",
    ),
    Rule(
        f"{PACKAGE}.strategies",
        tuple(f"{PACKAGE}.{name}" for name in ("training", "objectives", "training_config", "cli")),
        "a strategy maps rewards to objectives and weighs them, below the loop and the loader",
    ),
)


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def violations(graph: dict[str, set[str]], rules: tuple[Rule, ...] = RULES) -> list[str]:
    """One line per import that breaks a rule: who imports what, and why it may not."""
    found = []
    for rule in rules:
        for module in sorted(name for name in graph if _under(name, rule.importer)):
            for target in sorted(graph[module]):
                allowed = (rule.importer, *rule.allowed)
                if any(_under(target, p) for p in rule.forbidden) and not any(
                    _under(target, p) for p in allowed
                ):
                    found.append(f"{module} imports {target}: {rule.why}")
    return found


def test_every_layer_imports_only_what_sits_below_it() -> None:
    broken = violations(import_graph())
    assert not broken, "layering broken:\n" + "\n".join(broken)


def test_a_planted_lazy_or_type_checking_import_is_caught(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from mogradient_diffusion.training.trainer import Trainer\n"
        "def later():\n"
        "    import mogradient_diffusion.strategies.marble\n"
        "    from mogradient_diffusion import training_config\n"
        "    from mogradient_diffusion.advantages import group_advantages\n"
    )
    name = f"{PACKAGE}.objectives.planted"
    graph = {name: imported(name, planted, modules())}
    assert [line.split(":")[0] for line in violations(graph)] == [
        f"{name} imports {PACKAGE}.strategies.marble",
        f"{name} imports {PACKAGE}.training.trainer",
        f"{name} imports {PACKAGE}.training_config",
    ]


def test_a_prefix_is_a_whole_module_name_and_an_allowed_room_is_not_forbidden() -> None:
    assert not _under(f"{PACKAGE}.training_config", f"{PACKAGE}.training")
    graph = {
        f"{PACKAGE}.model.policy": {f"{PACKAGE}.config.settings", f"{PACKAGE}.sampling.ode"},
        "mogradient.amortize": {"mogradient.harmonizers"},
    }
    assert violations(graph) == [
        f"{PACKAGE}.model.policy imports {PACKAGE}.sampling.ode: the model (policy, "
        "pipelines) sits below sampling and RL"
    ]
