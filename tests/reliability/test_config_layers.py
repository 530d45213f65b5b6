"""Config layers (preset, ``base:`` files, the file, overrides) never drop a lower layer's
section; boolean harmonizer options are bools; path settings expand ``~`` and ``$VAR``."""

from __future__ import annotations

import inspect
import typing
from pathlib import Path

import numpy as np
import pytest

from mogradient.harmonizers import HARMONIZERS
from mogradient_diffusion.cli import main
from mogradient_diffusion.strategies.harmonizer import unfit_reason
from mogradient_diffusion.training_config import TINY_PRESET, ConfigError, load_config

from .conftest import train_arguments

EMPTY_ROLLOUT = "rollout:\n#  steps: 8\n#  resolution: 128\n"


def _one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


def _write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    return path


# --- an empty or non-mapping section ------------------------------------------------------


@pytest.mark.parametrize("overrides", [[], ["rollout.steps=4"]])
def test_an_empty_section_changes_nothing_even_with_an_override(
    tmp_path: Path, overrides: list[str]
) -> None:
    """Keys all commented out read as ``rollout: null``: the preset's rollout stays whole."""
    path = _write(tmp_path, "recipe.yaml", EMPTY_ROLLOUT)
    rollout = load_config(path, overrides, preset="tiny").rollout
    expected = TINY_PRESET["rollout"]
    assert (rollout.resolution, rollout.images_per_prompt, rollout.prompts_per_epoch) == (
        expected["resolution"],
        expected["images_per_prompt"],
        expected["prompts_per_epoch"],
    )
    assert rollout.steps == 4


def test_an_empty_section_in_a_file_keeps_its_base_files_section(tmp_path: Path) -> None:
    _write(tmp_path, "base.yaml", "train:\n  epochs: 7\n")
    path = _write(tmp_path, "recipe.yaml", "base: base.yaml\ntrain:\n")
    assert load_config(path, ["train.batch_size=4"], preset="tiny").train.epochs == 7


@pytest.mark.parametrize("overrides", [[], ["train.epochs=1"]])
def test_a_section_that_is_not_a_mapping_is_refused_naming_key_and_file(
    tmp_path: Path, overrides: list[str]
) -> None:
    path = _write(tmp_path, "recipe.yaml", "train: 5\n")
    with pytest.raises(ConfigError, match=r"recipe\.yaml: `train:` must be a mapping"):
        load_config(path, overrides, preset="tiny")


def test_a_bad_section_in_a_base_file_names_the_base_file(tmp_path: Path) -> None:
    _write(tmp_path, "base.yaml", "rollout: [64, 4]\n")
    path = _write(tmp_path, "recipe.yaml", "base: base.yaml\n")
    with pytest.raises(ConfigError, match=r"base\.yaml: `rollout:` must be a mapping"):
        load_config(path, ["rollout.steps=4"], preset="tiny")


@pytest.mark.parametrize("override", ["train=5", "rollout=", "rollout=null"])
def test_an_override_that_replaces_a_section_with_a_value_is_refused(override: str) -> None:
    with pytest.raises(ConfigError, match=f"override '{override}'"):
        load_config(preset="tiny", overrides=[override])


def test_an_override_may_give_a_whole_section_as_a_mapping() -> None:
    config = load_config(preset="tiny", overrides=["rollout={steps: 2}"])
    assert (config.rollout.steps, config.rollout.resolution) == (2, 64)


@pytest.mark.parametrize(
    ("text", "overrides"),
    [("train: 5\n", ["train.epochs=1"]), ("train: 5\n", []), ("base: 3\n", [])],
)
def test_a_bad_section_on_the_command_line_is_one_line(
    tmp_path: Path, capsys, never_load_the_model, text: str, overrides: list[str]
) -> None:
    path = _write(tmp_path, "recipe.yaml", text)
    arguments = ["train", "--config", str(path), "--preset", "tiny", *overrides]
    assert main(arguments) == 2
    line = _one_line(capsys.readouterr().err)
    assert "recipe.yaml" in line and text.split(":")[0] in line


# --- boolean harmonizer options -----------------------------------------------------------


def _bool_options() -> list[tuple[str, str]]:
    """(harmonizer, option) for every constructor parameter annotated ``bool``."""
    found = []
    for name, cls in HARMONIZERS.items():
        hints = typing.get_type_hints(cls.__init__)
        for parameter in inspect.signature(cls.__init__).parameters:
            if hints.get(parameter) is bool:
                found.append((name, parameter))
    return found


BOOL_OPTIONS = _bool_options()


def test_the_bool_options_are_found() -> None:
    assert ("mgda", "normalize") in BOOL_OPTIONS and len(BOOL_OPTIONS) >= 7


@pytest.mark.parametrize(("name", "option"), BOOL_OPTIONS)
@pytest.mark.parametrize("value", ["false", "False", 0, 1, None, "yes"])
def test_a_bool_option_refuses_what_is_not_a_bool(name: str, option: str, value) -> None:
    with pytest.raises(ValueError, match=rf"{option} .*{value!r}"):
        HARMONIZERS[name](**{option: value})


@pytest.mark.parametrize(("name", "option"), BOOL_OPTIONS)
@pytest.mark.parametrize("value", [True, False, np.bool_(True), np.bool_(False)])
def test_a_bool_option_takes_a_bool(name: str, option: str, value) -> None:
    harmonizer = HARMONIZERS[name](**{option: value})
    stored = [item for item in vars(harmonizer).values() if type(item) is bool]
    assert bool(value) in stored


TRAINABLE_BOOL_OPTIONS = [item for item in BOOL_OPTIONS if not unfit_reason(HARMONIZERS[item[0]])]


@pytest.mark.parametrize(("name", "option"), TRAINABLE_BOOL_OPTIONS)
def test_a_quoted_false_in_strategy_options_is_refused(name: str, option: str) -> None:
    overrides = [f"strategy.name={name}", f'strategy.options={{{option}: "false"}}']
    with pytest.raises(ConfigError, match=f"{option} must be True or False, got 'false'"):
        load_config(preset="tiny", overrides=overrides)


def test_a_quoted_false_in_a_config_file_is_one_line(
    tmp_path: Path, capsys, never_load_the_model
) -> None:
    path = _write(
        tmp_path, "recipe.yaml", 'strategy:\n  name: mgda\n  options: {normalize: "false"}\n'
    )
    assert main(["train", "--config", str(path), "--preset", "tiny"]) == 2
    assert "normalize must be True or False" in _one_line(capsys.readouterr().err)


def test_an_unquoted_false_in_strategy_options_is_a_bool() -> None:
    options = ["strategy.name=mgda", "strategy.options={normalize: false}"]
    config = load_config(preset="tiny", overrides=options)
    assert config.strategy.settings.options == {"normalize": False}


# --- paths: ~ and $VAR --------------------------------------------------------------------


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HOME (and $DATA) in a tmp folder; the working directory another one."""
    folder = tmp_path / "home"
    folder.mkdir()
    monkeypatch.setenv("HOME", str(folder))
    monkeypatch.setenv("DATA", str(folder / "data"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return folder


@pytest.mark.parametrize("written", ["~/runs/x", "$HOME/runs/x", "${HOME}/runs/x"])
@pytest.mark.parametrize("key", ["run.directory", "model.path", "prompts.directory"])
def test_a_path_setting_expands_home_and_variables(home: Path, key: str, written: str) -> None:
    overrides = [f"{key}={written}"]
    if key == "prompts.directory":
        overrides.append("prompts.sources=[{name: mine, file: train.txt}]")
    config = load_config(preset="tiny", overrides=overrides)
    section, name = key.split(".")
    assert getattr(getattr(config, section), name) == str(home / "runs" / "x")


def test_a_path_in_a_config_file_expands_too(home: Path, tmp_path: Path) -> None:
    path = _write(tmp_path, "recipe.yaml", "run:\n  directory: ~/runs/y\n")
    assert load_config(path, preset="tiny").run.directory == str(home / "runs" / "y")


def test_prompt_files_and_reward_paths_expand(home: Path) -> None:
    config = load_config(
        preset="tiny",
        overrides=[
            "prompts.directory=$DATA",
            "prompts.sources=[{name: mine, file: ~/prompts.txt}]",
            "rewards=[{name: pickscore, options: {path: ~/pickscore, processor_path: $DATA/p}}]",
        ],
    )
    assert config.prompts.directory == str(home / "data")
    assert config.prompts.sources[0].file == str(home / "prompts.txt")
    assert config.rewards[0].options == {
        "path": str(home / "pickscore"),
        "processor_path": str(home / "data" / "p"),
    }


def test_an_unset_variable_in_a_path_is_refused(home: Path) -> None:
    with pytest.raises(ConfigError, match=r"run.directory=.*\$NO_SUCH_VARIABLE_X is not set"):
        load_config(preset="tiny", overrides=["run.directory=$NO_SUCH_VARIABLE_X/run"])


def test_training_into_a_home_run_directory_makes_no_folder_named_tilde(
    home: Path, tiny_pipeline_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CLI takes the run's lock (creating its folder) before the trainer starts."""
    seen: list[str] = []

    def trainer(config, world, allow_config_change):
        seen.append(config.run.directory)
        raise ConfigError("stop here")

    monkeypatch.setattr("mogradient_diffusion.training.trainer.Trainer", trainer)
    assert main(train_arguments(Path("~/runs/z"), tiny_pipeline_dir)) == 2
    assert seen == [str(home / "runs" / "z")]
    assert (home / "runs" / "z").is_dir() and not Path("~").exists()
