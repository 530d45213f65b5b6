"""A training run's whole configuration: the sections, YAML + ``key=value`` overrides,
validated up front.

Everything a run needs is checked here, before any model is loaded: unknown keys, wrong
types and inconsistent batch arithmetic fail with one message that names the key and
says how to fix it. This module sits above the parts it assembles (the sections of
``config.settings``, the objectives, the strategies, the rewards); none of them imports it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import os
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mogradient.registry import UnknownNameError, import_user_modules
from mogradient_diffusion.config.devices import parse_device
from mogradient_diffusion.config.settings import (
    ConfigError,
    ModelConfig,
    PromptsConfig,
    PromptSourceConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    TrainConfig,
)
from mogradient_diffusion.config.yaml_text import YamlProblem, parse_yaml, read_yaml
from mogradient_diffusion.model.families import FAMILIES
from mogradient_diffusion.model.limits import max_resolution
from mogradient_diffusion.model.pipeline_files import AUTO
from mogradient_diffusion.model.policy import DTYPES, SHARDING, LoraSpec
from mogradient_diffusion.objectives import OBJECTIVES, UnknownObjectiveError, objective_class
from mogradient_diffusion.sampling.solver import SAMPLERS
from mogradient_diffusion.strategies import strategy_type


@dataclass
class ObjectiveConfig:
    """The RL objective and its settings: ``objective: {name: nft, beta: 0.1, ...}``.

    In YAML the options sit beside ``name``; here they are the objective's own frozen
    settings dataclass (``mogradient_diffusion.objectives``), built and validated by it.
    """

    name: str = "nft"
    settings: Any = None  # None: the objective's defaults

    def __post_init__(self) -> None:
        if self.settings is None:
            self.settings = objective_class(self.name).settings_type()

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **dataclasses.asdict(self.settings)}


# The keys every saved ``strategy:`` section held before each strategy owned its settings,
# unset. A resume compares the saved config with the new one key by key, so the section
# keeps listing them all: a run saved then resumes, and config.yaml reads as it did.
SAVED_STRATEGY_KEYS: dict[str, Any] = {
    "weights": None,
    "reward": None,
    "stages": [],
    "period": None,
    "warmup_steps": None,
    "rho": None,
    "smooth_solve_steps": None,
    "normalize": None,
    "fixed_alpha": None,
    "solve_scope": None,
    "alpha_lower_bound": None,
    "unit_weights": None,
    "reward_groups": [],
    "dropout_probability": None,
    "dropout_warmup_steps": None,
    "options": {},
}


@dataclass
class StrategyConfig:
    """The training strategy and its settings: ``strategy: {name: marble, period: 2, ...}``.

    In YAML the options sit beside ``name``; here they are the strategy's own frozen
    settings dataclass (``mogradient_diffusion.strategies``), built and validated by it.
    """

    name: str = "marble"
    settings: Any = None  # None: the strategy's defaults

    def __post_init__(self) -> None:
        if self.settings is None:
            self.settings = strategy_type(self.name).settings_type()

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **SAVED_STRATEGY_KEYS, **dataclasses.asdict(self.settings)}


@dataclass
class TrainingConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraSpec = field(default_factory=LoraSpec)
    prompts: PromptsConfig = field(default_factory=PromptsConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    # Modules imported before the rewards are looked up: where user rewards register.
    reward_modules: list[str] = field(default_factory=list)
    rewards: list[RewardConfig] = field(default_factory=list)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict[str, Any]:
        plain = _plain(dataclasses.asdict(self))
        plain["objective"] = _plain(self.objective.to_dict())
        plain["strategy"] = _plain(self.strategy.to_dict())
        plain["rewards"] = [_plain(reward.to_dict()) for reward in self.rewards]
        return plain


# Settings that name a file or folder: ``~`` and ``$VAR`` are expanded (``expand_paths``).
PATH_KEYS = ("model.path", "prompts.directory", "run.directory")
RUN_CONFIG_NAME = re.compile(r"config\.yaml|resume-\d+\.yaml")
MAX_SEED = 2**63 - 1  # numpy and torch take any seed in [0, 2**63)

TINY_PRESET: dict[str, Any] = {
    "model": {"path": None, "device": "cpu"},
    "lora": {"rank": 4, "alpha": 8},
    "rollout": {
        "resolution": 64,
        "steps": 4,
        "images_per_prompt": 4,
        "prompts_per_epoch": 2,
        "batch_size": 8,
        "max_sequence_length": 32,
    },
    "train": {"epochs": 3, "batch_size": 4, "timestep_fraction": 0.5, "learning_rate": 1e-3},
    # graded against 0.25: the untrained tiny model's images each hold about the same share
    # of every color (0-20%), so a 0/1 threshold scored whole prompt groups alike (no
    # signal in epochs 0-1); graded, every color but black differs within a group.
    "rewards": [
        {"name": "color_match", "options": {"min_share": 0.25, "graded": True}},
        {"name": "jpeg_incompressibility"},
    ],
    "strategy": {"name": "marble", "period": 2},
    "run": {"directory": "runs/tiny", "checkpoint_every": 1},
}
PRESETS = {"tiny": TINY_PRESET}


def load_config(
    path: str | Path | None = None,
    overrides: list[str] = (),
    preset: str | None = None,
    world_size: int = 1,
    default_preset: str | None = None,
) -> TrainingConfig:
    """Preset, then the YAML file, then ``a.b=value`` overrides; validated as a whole.

    Each is a layer; a layer that names another strategy starts that strategy from its
    own defaults (the options below it belonged to the strategy it replaces).
    ``default_preset`` is the preset when none is named and no layer sets ``model.path``
    (the tiny model is built then, and the full-size defaults do not fit it).
    """
    file_layer = {} if path is None else _read_yaml(Path(path))
    command_line: dict[str, Any] = {}
    for override in overrides:
        command_line = _merge(command_line, _parse_override(override))
    if preset is None and not _names_model_path(_merge(file_layer, command_line)):
        preset = default_preset
    raw: dict[str, Any] = {}
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
        raw = _merge_layer(raw, _checked_sections(PRESETS[preset], f"preset {preset!r}"))
    if path is not None:
        raw = _merge_layer(raw, file_layer)
    home = None if path is None else run_home(Path(path))
    if home is not None and "directory" not in command_line.get("run", {}):
        raw = _merge(raw, {"run": {"directory": str(home)}})
    raw = _merge_layer(raw, command_line)
    # before any section is built: the user's modules may register the strategy, the
    # objective or the model family the config names, not only rewards
    modules = raw.get("reward_modules", [])
    import_reward_modules(_convert(list[str], modules, "reward_modules"))
    config = _build(TrainingConfig, raw, "config")
    expand_paths(config)
    validate(config, world_size)
    return config


def _names_model_path(raw: dict[str, Any]) -> bool:
    model = raw.get("model")
    return isinstance(model, dict) and not _unset(model.get("path"))


def expand_path(value: str, key: str) -> str:
    """``~`` and ``$VAR`` expanded, as a shell would: unexpanded, ``~/x`` becomes a folder
    literally named ``~`` in the working directory. An unset variable is refused (it would
    leave a folder named ``$VAR``)."""
    expanded = os.path.expandvars(os.path.expanduser(value))
    unset = re.search(r"\$(\w+|\{[^}]*\})", expanded)
    if unset:
        raise ConfigError(
            f"{key}={value!r}: the environment variable {unset.group(0)} is not set; "
            "set it or write the path out"
        )
    return expanded


def expand_paths(config: TrainingConfig) -> None:
    """Expand every path-valued setting in place, once, so that no part of the trainer
    has to remember to: the sections' paths, prompt files and rewards' path options."""
    for key in PATH_KEYS:
        section, name = key.split(".")
        holder = getattr(config, section)
        if isinstance(getattr(holder, name), str):
            setattr(holder, name, expand_path(getattr(holder, name), key))
    for source in config.prompts.sources:
        source.file = expand_path(source.file, f"prompts.sources {source.name!r} file")
    for reward in config.rewards:
        paths = _path_options(reward, config.reward_modules)
        reward.options = {  # a new dict: the options may be a preset's own
            option: expand_path(value, f"reward {reward.run_name!r} option {option}")
            if option in paths and isinstance(value, str)
            else value
            for option, value in reward.options.items()
        }


def _path_options(reward: RewardConfig, modules: list[str]) -> list[str]:
    """The reward's constructor parameters annotated as paths (``str | os.PathLike``), so
    a new reward's path options are expanded without being listed here."""
    from mogradient_diffusion.rewards import REWARDS

    import_reward_modules(modules)
    if reward.name not in REWARDS:
        return []  # validate() names the unknown reward
    parameters = inspect.signature(REWARDS[reward.name].__init__).parameters.values()
    return [item.name for item in parameters if "PathLike" in str(item.annotation)]


def run_home(path: Path) -> Path | None:
    """The run a config file belongs to: the folder of a run's ``config.yaml`` or
    ``resume-<n>.yaml`` (one holding ``checkpoints/`` or ``metrics.jsonl``), else None.

    A run is where its files are: the ``run.directory`` recorded inside is where it was
    first trained, which is wrong once the folder moved or the working directory changed.
    """
    if not RUN_CONFIG_NAME.fullmatch(path.name):
        return None
    folder = path.parent
    holds_a_run = (folder / "checkpoints").is_dir() or (folder / "metrics.jsonl").is_file()
    return folder if holds_a_run else None


def read_run_config(path: Path) -> dict[str, Any]:
    """A run's saved config (``config.yaml``), or a one-line ConfigError saying it is damaged."""
    try:
        data = read_yaml(path)
    except YamlProblem as error:
        problem = f"cannot be read (it is {error})"
    else:
        if isinstance(data, dict) and data:
            return data
        problem = "is empty" if data is None else f"holds a {type(data).__name__}, not a config"
    raise ConfigError(
        f"{path} {problem}: restore the run's config there, or use a new run.directory"
    )


def validate(config: TrainingConfig, world_size: int = 1) -> None:
    """Semantic checks that types alone cannot express."""
    rollout, train = config.rollout, config.train
    _check_device("model.device", config.model.device)
    _choice("model.dtype", config.model.dtype, tuple(DTYPES))
    _choice("model.family", config.model.family, (AUTO, *FAMILIES))
    if config.model.guidance is not None and not config.model.guidance > 0:
        raise ConfigError(f"model.guidance must be > 0 or null, got {config.model.guidance}")
    _choice("model.shard", config.model.shard, SHARDING)
    if config.model.shard != "none" and world_size == 1:
        raise ConfigError(
            f"model.shard={config.model.shard} shards the frozen weights over the torchrun "
            "processes, and this run has one: start it with torchrun --nproc_per_node N "
            "(N >= 2), or set model.shard=none"
        )
    _choice("rollout.sampler", rollout.sampler, SAMPLERS)
    _choice("train.old_schedule", train.old_schedule, ("copy", "linear", "delayed_linear"))
    _choice("train.gradient_engine", train.gradient_engine, ("auto", "batched"))
    for key, value in [
        ("rollout.resolution", rollout.resolution),
        ("rollout.steps", rollout.steps),
        ("rollout.images_per_prompt", rollout.images_per_prompt),
        ("rollout.prompts_per_epoch", rollout.prompts_per_epoch),
        ("rollout.batch_size", rollout.batch_size),
        ("train.epochs", train.epochs),
        ("train.batch_size", train.batch_size),
        ("train.gradient_accumulation", train.gradient_accumulation),
        ("train.max_nonfinite_steps", train.max_nonfinite_steps),
        ("rollout.max_sequence_length", rollout.max_sequence_length),
    ]:
        if value < 1:
            raise ConfigError(f"{key} must be >= 1, got {value}")
    if rollout.resolution % 16:
        raise ConfigError(f"rollout.resolution must be a multiple of 16, got {rollout.resolution}")
    _check_resolution_fits(rollout.resolution, config.model.path)
    if not 0 < train.timestep_fraction <= 1:
        raise ConfigError(
            f"train.timestep_fraction must be in (0, 1], got {train.timestep_fraction}"
        )
    _check_ranges(config)
    _check_batch_arithmetic(config, world_size)
    _check_rewards_and_strategy(config)
    objective_class(config.objective.name).check_config(
        config.objective.settings, config.rollout, config.train
    )
    _check_loggers(config.run)


def _check_loggers(run: RunConfig) -> None:
    """run.loggers: known names, jsonl kept (resume and plots read metrics.jsonl), and the
    chosen backends' packages installed, before any model loads."""
    import importlib.util

    from mogradient_diffusion.runs.loggers import LOGGERS

    try:
        names = [LOGGERS.canonical(name) for name in run.loggers]
    except UnknownNameError as error:
        raise ConfigError(f"run.loggers: {error}") from None
    if "jsonl" not in names:
        raise ConfigError(
            f"run.loggers={run.loggers} must include jsonl: resume and plots read metrics.jsonl"
        )
    _choice("run.wandb_mode", run.wandb_mode, ("offline", "online"))
    for name in names:
        logger = LOGGERS[name]
        if logger.requires and importlib.util.find_spec(logger.requires) is None:
            raise ConfigError(
                f"run.loggers: {name} needs the {logger.requires} package: {logger.install}"
            )


def _check_resolution_fits(resolution: int, model_path: str | None) -> None:
    """A resolution beyond the transformer's position embedding fails in the first forward
    pass, after the model has loaded; ``max_resolution`` reads the bound off its configs."""
    limit = max_resolution(model_path)
    if limit is not None and resolution > limit:
        model = "the tiny model (model.path unset)" if model_path is None else model_path
        raise ConfigError(
            f"rollout.resolution={resolution} is more than {model} can take (its position "
            f"embedding covers {limit} px): choose a multiple of 16 from 16 to {limit}"
        )


def _check_ranges(config: TrainingConfig) -> None:
    train, run = config.train, config.run
    beta1, beta2 = train.adam_betas
    guidance = config.rollout.guidance_scale
    checks = [
        (
            "train.adam_betas",
            list(train.adam_betas),
            0 <= beta1 < 1 and 0 <= beta2 < 1,
            "in [0, 1)",
        ),
        ("train.weight_decay", train.weight_decay, train.weight_decay >= 0, ">= 0"),
        ("train.ema_decay", train.ema_decay, 0 <= train.ema_decay < 1, "in [0, 1)"),
        ("train.learning_rate", train.learning_rate, train.learning_rate > 0, "> 0"),
        ("train.grad_clip", train.grad_clip, train.grad_clip > 0, "> 0"),
        ("rollout.guidance_scale", guidance, guidance >= 0, ">= 0"),
        ("run.checkpoint_every", run.checkpoint_every, run.checkpoint_every >= 1, ">= 1"),
        ("run.keep_checkpoints", run.keep_checkpoints, run.keep_checkpoints >= 1, ">= 1"),
        ("run.seed", run.seed, 0 <= run.seed <= MAX_SEED, f"in [0, {MAX_SEED}]"),
    ]
    if train.old_cap is not None:  # unset means the schedule's own cap
        checks.append(("train.old_cap", train.old_cap, 0 <= train.old_cap < 1, "in [0, 1)"))
    for key, value, ok, expected in checks:
        if not ok:
            raise ConfigError(f"{key} must be {expected}, got {value}")
    prompts = config.prompts
    if prompts.sources and prompts.directory is None:
        raise ConfigError(
            "prompts.sources is set but prompts.directory is not: say where the files are "
            "(without both, the built-in miniature prompts are used)"
        )
    if prompts.directory is not None and not prompts.sources:
        raise ConfigError("prompts.directory is set but prompts.sources is empty")
    _check_prompt_sources(prompts.sources)


def _check_prompt_sources(sources: list[PromptSourceConfig]) -> None:
    names = [source.name for source in sources]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ConfigError(f"prompts.sources: each source needs its own name; repeated: {repeated}")
    for source in sources:
        if not source.weight > 0:
            raise ConfigError(
                f"prompts.sources {source.name!r}: weight must be > 0, got {source.weight} "
                "(remove the source to leave it out)"
            )


def _check_batch_arithmetic(config: TrainingConfig, world_size: int) -> None:
    rollout, train = config.rollout, config.train
    images = rollout.prompts_per_epoch * rollout.images_per_prompt
    if rollout.prompts_per_epoch % world_size:
        raise ConfigError(
            f"rollout.prompts_per_epoch={rollout.prompts_per_epoch} must be divisible by the "
            f"world size {world_size} so every process samples whole prompt groups"
        )
    per_process = images // world_size
    if per_process % train.batch_size:
        raise ConfigError(
            f"each process gets {per_process} images per epoch (prompts_per_epoch x "
            f"images_per_prompt / world size = {rollout.prompts_per_epoch} x "
            f"{rollout.images_per_prompt} / {world_size}), which train.batch_size="
            f"{train.batch_size} does not divide; change one of them"
        )
    micro_batches = per_process // train.batch_size
    if micro_batches % train.gradient_accumulation:
        raise ConfigError(
            f"{micro_batches} micro-batches per epoch are not a multiple of "
            f"train.gradient_accumulation={train.gradient_accumulation}"
        )
    if images < 2 * world_size or rollout.images_per_prompt < 2:
        raise ConfigError("rollout.images_per_prompt must be >= 2: advantages compare a group")


def import_reward_modules(modules: list[str]) -> None:
    """Import the user's modules (``reward_modules``), whose registrations (rewards,
    strategies, objectives, model families, harmonizers) the config may then name.

    A user's module may fail in any way while it runs (a missing key, a syntax error, a
    ``sys.exit``): the error is the user's to fix, so it is one line naming the module.
    """
    for module in modules:
        try:
            import_user_modules([module], "reward_modules")
        except ImportError as error:
            message = str(error)
            if not message.startswith("reward_modules: "):
                message = f"reward_modules: cannot import {module!r}: {message}"
            raise ConfigError(message) from error
        except (Exception, SystemExit) as error:
            raise ConfigError(
                f"reward_modules: importing {module!r} raised {_one_line(error)}; fix the "
                "module, or leave it out"
            ) from error


def _one_line(error: BaseException) -> str:
    """``Type: first line of the message``; ``sys.exit(3)`` reads ``SystemExit: 3``."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def _check_reward_options(reward: RewardConfig, cls: type) -> None:
    """Option names checked against the reward's constructor, before any weights load."""
    parameters = inspect.signature(cls.__init__).parameters
    accepted = [name for name in parameters if name != "self"]
    unknown = sorted(set(reward.options) - set(accepted))
    if unknown:
        raise ConfigError(
            f"reward {reward.run_name!r} has no option(s) {unknown}; its options: {accepted}"
        )


def _check_reward_deadline(reward: RewardConfig, cls: type, reward_timeout: float | None) -> None:
    """A reward with a ``deadline`` of its own (``remote``) must give up before
    ``rollout.reward_timeout`` stops the run: then its ``required`` option decides (one line,
    or NaN counted) rather than the time-out, which stops training whatever it says."""
    parameter = inspect.signature(cls.__init__).parameters.get("deadline")
    if parameter is None or reward_timeout is None:
        return
    deadline = reward.options.get("deadline", parameter.default)
    given = "" if "deadline" in reward.options else " (its default)"
    number = isinstance(deadline, (int, float)) and not isinstance(deadline, bool)
    if number and deadline >= reward_timeout:  # a bad value: the reward's own message
        raise ConfigError(
            f"reward {reward.run_name!r}: its deadline, {deadline:g} s{given}, must be below "
            f"rollout.reward_timeout ({reward_timeout:g} s), so that a server that stops "
            "answering fails as its required option says; lower the deadline option or "
            "raise rollout.reward_timeout"
        )


def _check_rewards_and_strategy(config: TrainingConfig) -> None:
    from mogradient_diffusion.rewards import REWARDS

    strategy = config.strategy
    import_reward_modules(config.reward_modules)
    if not config.rewards:
        raise ConfigError("no rewards configured: add at least one entry under `rewards:`")
    for reward in config.rewards:  # old spellings too (a reward keeps the name it is given)
        try:
            REWARDS.canonical(reward.name)
        except UnknownNameError as error:  # it names the closest rewards and every choice
            raise ConfigError(str(error)) from None
    names = _checked_labels(config.rewards, REWARDS.canonical)
    for reward in config.rewards:
        _check_reward_options(reward, REWARDS[reward.name])
        _check_reward_deadline(reward, REWARDS[reward.name], config.rollout.reward_timeout)
        if isinstance(reward.options.get("device"), str):
            _check_device(f"reward {reward.run_name!r} option device", reward.options["device"])
    strategy_type(strategy.name).check_config(
        strategy.name,
        strategy.settings,
        reward_names=names,
        objective=config.objective.name,
        objective_settings=config.objective.settings,
    )


def _checked_labels(rewards: list[RewardConfig], canonical: Callable[[str], str]) -> list[str]:
    """The names the run uses for its rewards (labels, else names), each once: a reward
    listed twice needs a label on each entry but one, and two spellings of one reward
    without labels are the same reward twice."""
    names = [reward.run_name for reward in rewards]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ConfigError(
            f"`rewards:` names {repeated} more than once: give each entry of the same reward "
            "a label of its own, e.g. {name: remote, label: geneval, options: {...}}"
        )
    plain = [canonical(reward.name) for reward in rewards if reward.label is None]
    twice = sorted({name for name in plain if plain.count(name) > 1})
    if twice:
        raise ConfigError(
            f"`rewards:` lists {twice} twice under different spellings: {names}; "
            "keep one, or label each entry"
        )
    return names


def _check_device(key: str, device: str) -> None:
    """A device must parse, and CUDA must exist to be asked for (else set_device fails late)."""
    if device == "auto":
        return
    try:
        kind = parse_device(device, key).type
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if kind not in ("cpu", "cuda"):
        raise ConfigError(f"{key}={device!r}: training runs on cpu or cuda devices only")


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key} must be one of {list(allowed)}, got {value!r}")


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A YAML config with its ``base:`` chain resolved (``seen``: the files that include it)."""
    resolved = _resolved(path)
    if resolved in seen:
        chain = " -> ".join(str(p) for p in (*seen, resolved))
        raise ConfigError(f"`base:` files include each other in a cycle: {chain}")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = read_yaml(path) or {}
    except YamlProblem as error:
        raise ConfigError(f"{path} is {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping at the top level")
    base = data.pop("base", None)
    data = _checked_sections(data, str(path))
    if base is not None:
        if not isinstance(base, str) or not base:
            raise ConfigError(f"{path}: `base:` must name a YAML file, got {base!r}")
        data = _merge_layer(_read_yaml(path.parent / base, (*seen, resolved)), data)
    return data


def _resolved(path: Path) -> Path:
    """``path`` with its links followed; a link that leads back to itself is a ConfigError
    (Python before 3.13 raises RuntimeError for it, later ones OSError)."""
    try:
        return path.resolve()
    except (OSError, RuntimeError):
        raise ConfigError(
            f"config file {path} is a symbolic link that leads back to itself: point it "
            "at a YAML file"
        ) from None


@functools.cache
def _sections() -> tuple[str, ...]:
    """The top-level keys that hold a section of settings (a mapping): ``model``, ``run``..."""
    hints = typing.get_type_hints(TrainingConfig)
    return tuple(name for name, hint in hints.items() if dataclasses.is_dataclass(hint))


def _checked_sections(layer: dict[str, Any], source: str) -> dict[str, Any]:
    """``layer`` with its empty sections left out, or a ConfigError naming ``source``.

    A section whose keys are all commented out reads as null: it changes nothing, so the
    layer below keeps its section. Anything else that is not a mapping is refused, else a
    later override of one key (``train.epochs=1``) would replace it and silently drop the
    whole section of the layers below (a preset's, a ``base:`` file's).
    """
    checked = dict(layer)
    for key in _sections():
        value = checked.get(key)
        if key in checked and value is None:
            del checked[key]
        elif key in checked and not isinstance(value, dict):
            raise ConfigError(
                f"{source}: `{key}:` must be a mapping of {key} settings (indented "
                f"`name: value` lines), got {value!r}"
            )
    return checked


def _parse_override(text: str) -> dict[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    try:
        parsed = parse_yaml(value) if value else None
    except YamlProblem as error:
        raise ConfigError(f"override {text!r}: the value is {error}") from None
    if key in _sections() and not isinstance(parsed, dict):
        raise ConfigError(
            f"override {text!r}: {key} is a section of settings; set one of its keys "
            f"({key}.<key>=value) or give a mapping ({key}={{key: value}})"
        )
    nested: dict[str, Any] = parsed
    for part in reversed(key.split(".")):
        nested = {part: nested}
    return nested


def _merge_layer(raw: dict[str, Any], layer: dict[str, Any]) -> dict[str, Any]:
    """``layer`` over ``raw``; naming another strategy or objective drops the options of
    the one it replaces."""
    for section, default in (
        ("strategy", StrategyConfig.name),
        ("objective", ObjectiveConfig.name),
    ):
        new, current = layer.get(section), raw.get(section)
        if (
            isinstance(new, dict)
            and isinstance(current, dict)
            and "name" in new
            and new["name"] != current.get("name", default)
        ):
            raw = {**raw, section: {}}
    return _merge(raw, layer)


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _build(cls: type, data: Any, where: str) -> Any:
    """A config dataclass from a mapping; its own ``__post_init__`` checks become
    ConfigErrors naming the key (their messages start with the field name)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {item.name for item in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in {where}; known: {sorted(names)}")
    values = {key: _convert(hints[key], value, f"{where}.{key}") for key, value in data.items()}
    try:
        return cls(**values)
    except TypeError as error:
        raise ConfigError(f"{where}: {error}") from None
    except ValueError as error:
        raise ConfigError(f"{where}.{error}") from None


def _build_objective(data: Any, where: str) -> ObjectiveConfig:
    """``{name, **options}``: the options are checked against the objective's settings."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(data).__name__}")
    options = dict(data)
    name = options.pop("name", ObjectiveConfig.name)
    try:
        settings_type = objective_class(name).settings_type
    except UnknownObjectiveError as error:
        raise ConfigError(f"{where}.name: {error}") from None
    accepted = [item.name for item in dataclasses.fields(settings_type)]
    unused = sorted(set(options) - set(accepted))
    if unused:
        raise ConfigError(
            f"objective {name!r} does not use {', '.join(f'{where}.{k}' for k in unused)}; "
            f"remove it (its options: {', '.join(accepted)})"
        )
    return ObjectiveConfig(OBJECTIVES.canonical(name), _build(settings_type, options, where))


def _build_strategy(data: Any, where: str) -> StrategyConfig:
    """``{name, **options}``: the options are checked against the strategy's settings.

    An option the strategy does not have is refused when set ("set" means given, whatever
    the value); left unset (null, [] or {}) it is passed over, as a saved run lists every
    strategy's keys (``SAVED_STRATEGY_KEYS``).
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(data).__name__}")
    options = dict(data)
    name = _convert(str, options.pop("name", StrategyConfig.name), f"{where}.name")
    try:
        settings_type = strategy_type(name).settings_type
    except UnknownNameError as error:
        raise ConfigError(f"strategy.name: {error}") from None
    accepted = [item.name for item in dataclasses.fields(settings_type)]
    unused = [key for key, value in options.items() if key not in accepted and not _unset(value)]
    if unused:
        raise ConfigError(
            f"strategy {name!r} does not use {', '.join(f'strategy.{k}' for k in unused)}; "
            f"remove it (its options: {', '.join(f'strategy.{k}' for k in accepted)})"
        )
    given = {key: value for key, value in options.items() if key in accepted}
    return StrategyConfig(name, _build(settings_type, given, "strategy"))


def _unset(value: Any) -> bool:
    return value is None or (isinstance(value, list | dict) and not value)


def _convert(hint: Any, value: Any, where: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [arg for arg in args if arg is not type(None)]
        return _convert(options[0], value, where)
    if hint is ObjectiveConfig:
        return _build_objective(value, where)
    if hint is StrategyConfig:
        return _build_strategy(value, where)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, where)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        return [_convert(args[0], item, f"{where}[{index}]") for index, item in enumerate(value)]
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        return tuple(_convert(args[0], item, where) for item in value)
    if origin is tuple:
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise ConfigError(f"{where} must be a list of {len(args)} values, got {value!r}")
        return tuple(_convert(arg, item, where) for arg, item in zip(args, value, strict=True))
    if origin is dict or hint is Any:
        if origin is dict and not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping, got {value!r}")
        return value
    if hint is float:
        return _finite_float(value, where)
    if hint in (int, float, str, bool) and (
        not isinstance(value, hint) or (hint is int and isinstance(value, bool))
    ):
        raise ConfigError(f"{where} must be {hint.__name__}, got {value!r}")
    return value


def _finite_float(value: Any, where: str) -> float:
    """Ints and numeric strings become floats (PyYAML reads ``3e-4`` as a string); inf and
    NaN are refused: a non-finite rate or coefficient would poison the weights."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ConfigError(f"{where} must be a number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{where} must be a finite number, got {value!r}")
    return float(value)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value
