"""Inputs that used to end in a traceback (or minutes of work) end in one line: a binary
or alias-bomb config, a looping ``base:``, torchrun variables left in a shell, a resolution
the model cannot take, a binary tail in metrics.jsonl, a reward module that raises on
import, and junk given to the checkpoint converters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mogradient_diffusion.cli import main
from mogradient_diffusion.model.limits import max_resolution
from mogradient_diffusion.rewards import Reward, register_reward
from mogradient_diffusion.rewards.image_reward import convert_image_reward_checkpoint
from mogradient_diffusion.rewards.open_clip_conversion import convert_open_clip_checkpoint
from mogradient_diffusion.runs.metrics_log import RunLog, read_metrics
from mogradient_diffusion.training.distributed import World
from mogradient_diffusion.training_config import ConfigError, load_config

from .conftest import train_arguments


def _nested_aliases(levels: int) -> str:
    """A YAML list of anchored lists, each nine aliases of the one before: 9**levels values
    from a few hundred bytes (a "billion laughs")."""
    items, below = [], None
    for name in "abcdefgh"[:levels]:
        values = [f"*{below}"] * 9 if below else ["x"] * 9
        items.append(f"&{name} [{', '.join(values)}]")
        below = name
    return f"[{', '.join(items)}]"


BOMB = _nested_aliases(6)  # 531441 values once expanded


def _one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


def _error_of(arguments: list[str], capsys) -> str:
    assert main(arguments) == 2
    return _one_line(capsys.readouterr().err)


# --- config files and overrides -----------------------------------------------------------


def _recipe(folder: Path, text: str, name: str = "recipe.yaml") -> Path:
    path = folder / name
    path.write_text(text)
    return path


def test_an_alias_bomb_in_a_config_file_is_one_line(tmp_path: Path, capsys) -> None:
    options = f"rewards:\n  - name: jpeg_incompressibility\n    options:\n      quality: {BOMB}\n"
    recipe = _recipe(tmp_path, options)
    assert len(recipe.read_bytes()) < 400
    error = _error_of(["train", "--config", str(recipe), "--preset", "tiny"], capsys)
    assert f"{recipe} is too big: more than 100000 values once its YAML aliases" in error


@pytest.mark.parametrize(
    "override",
    [
        f"rewards=[{{name: jpeg_incompressibility, options: {{quality: {BOMB}}}}}]",
        "strategy.options={a: &loop [*loop]}",
    ],
)
def test_an_alias_bomb_or_loop_in_an_override_is_refused(override: str) -> None:
    with pytest.raises(ConfigError, match=r"override .*: the value is (too big|not a config)"):
        load_config(preset="tiny", overrides=[override])


def test_a_config_with_a_few_aliases_still_loads(tmp_path: Path) -> None:
    recipe = _recipe(
        tmp_path,
        "strategy:\n  name: sequential\n  stages:\n"
        "    - {rewards: &both [color_match, jpeg_incompressibility], epochs: 1}\n"
        "    - {rewards: *both, epochs: 2}\n"
        "rollout: &rollout {steps: 4}\n",
    )
    config = load_config(recipe, preset="tiny")
    assert [stage.rewards for stage in config.strategy.settings.stages] == [
        ["color_match", "jpeg_incompressibility"]
    ] * 2


def test_a_binary_config_file_is_one_line(tmp_path: Path, capsys) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe")
    error = _error_of(["train", "--config", str(recipe)], capsys)
    assert f"{recipe} is not UTF-8 text (byte 0x89 at offset 0)" in error


def test_invalid_yaml_is_one_line(tmp_path: Path, capsys) -> None:
    recipe = _recipe(tmp_path, "train:\n  epochs: [1,\n")
    error = _error_of(["train", "--config", str(recipe)], capsys)
    assert f"{recipe} is not valid YAML: " in error and "(line 3, column 1)" in error


@pytest.mark.parametrize(
    ("base", "message"),
    [
        ("[a.yaml, b.yaml]", "`base:` must name a YAML file, got ['a.yaml', 'b.yaml']"),
        ("3", "`base:` must name a YAML file, got 3"),
        ("loop.yaml", "loop.yaml is a symbolic link that leads back to itself"),
    ],
)
def test_a_base_that_names_no_file_is_one_line(
    tmp_path: Path, capsys, base: str, message: str
) -> None:
    (tmp_path / "loop.yaml").symlink_to(tmp_path / "other.yaml")
    (tmp_path / "other.yaml").symlink_to(tmp_path / "loop.yaml")
    recipe = _recipe(tmp_path, f"base: {base}\n")
    assert message in _error_of(["train", "--config", str(recipe)], capsys)


def test_a_config_that_is_a_symlink_loop_is_one_line(tmp_path: Path, capsys) -> None:
    (tmp_path / "a.yaml").symlink_to(tmp_path / "b.yaml")
    (tmp_path / "b.yaml").symlink_to(tmp_path / "a.yaml")
    error = _error_of(["train", "--config", str(tmp_path / "a.yaml")], capsys)
    assert "a.yaml is a symbolic link that leads back to itself" in error


# --- torchrun's variables left in the environment -----------------------------------------

TORCHRUN = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.mark.parametrize(
    ("environment", "message"),
    [
        ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' in the environment is not an integer"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 in the environment must be >= 1"),
        ({"WORLD_SIZE": "-1"}, "WORLD_SIZE=-1 in the environment must be >= 1"),
        ({"LOCAL_RANK": "x"}, "LOCAL_RANK='x' in the environment is not an integer"),
        ({"LOCAL_RANK": "-1"}, "LOCAL_RANK=-1 in the environment must be >= 0"),
        ({"WORLD_SIZE": "1", "LOCAL_RANK": "1"}, "LOCAL_RANK=1 in the environment is not below"),
        ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2 in the environment is not below WORLD_SIZE"),
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 is in the environment but RANK, MASTER_ADDR"),
    ],
)
def test_torchrun_variables_with_values_torchrun_never_sets_are_refused(
    monkeypatch, environment: dict[str, str], message: str
) -> None:
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    fix = "unset it to train in one process, or start the run with torchrun"
    for read in (World.size_from_environment, lambda: World.from_environment("cpu")):
        with pytest.raises(ConfigError, match=message) as caught:
            read()
        assert fix in str(caught.value)


def test_a_bad_world_size_stops_train_in_one_line(
    tmp_path: Path, tiny_pipeline_dir: Path, capsys, monkeypatch, never_load_the_model
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "two")
    error = _error_of(train_arguments(tmp_path, tiny_pipeline_dir), capsys)
    assert "WORLD_SIZE='two' in the environment is not an integer" in error


# --- a resolution the model cannot take ---------------------------------------------------


@pytest.mark.parametrize("model", ["tiny preset", "tiny directory"])
def test_a_resolution_beyond_the_models_position_embedding_is_one_line(
    tmp_path: Path, tiny_pipeline_dir: Path, capsys, never_load_the_model, model: str
) -> None:
    arguments = train_arguments(tmp_path, tiny_pipeline_dir, "rollout.resolution=512")
    if model == "tiny preset":
        arguments.remove(f"model.path={tiny_pipeline_dir}")
    error = _error_of(arguments, capsys)
    assert "rollout.resolution=512 is more than" in error
    assert "choose a multiple of 16 from 16 to 256" in error


def test_the_tiny_models_bound_is_the_one_its_files_record(tiny_pipeline_dir: Path) -> None:
    """The bound of the unbuilt tiny model (model.path unset) is the saved one's."""
    assert max_resolution(None) == max_resolution(str(tiny_pipeline_dir)) == 256
    assert load_config(preset="tiny", overrides=["rollout.resolution=256"])


# --- a binary tail in metrics.jsonl -------------------------------------------------------


def test_a_binary_tail_in_metrics_is_a_torn_line(tmp_path: Path) -> None:
    """A crash mid-write can leave binary bytes where the last record was cut: readers
    leave the line out and a resume (``RunLog`` from step 2) drops it."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_bytes(b'{"step": 0}\n{"step": 1}\n\x00\x00\xff\xfe\x89garbage\xc3')
    assert [record["step"] for record in read_metrics(tmp_path)] == [0, 1]
    RunLog(tmp_path, resume_from_step=2).close()
    assert metrics.read_bytes() == b'{"step": 0}\n{"step": 1}\n'


def test_a_binary_line_inside_metrics_is_named(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 0}\n\xff\xfe\n{"step": 1}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2 is not a JSON record"):
        read_metrics(tmp_path)
    RunLog(tmp_path, resume_from_step=2).close()  # a resume drops the damaged line
    assert (tmp_path / "metrics.jsonl").read_bytes() == b'{"step": 0}\n{"step": 1}\n'


# --- a reward module that raises on import ------------------------------------------------


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('raise RuntimeError("no API key in SCORER_KEY\\nsee the docs")', "RuntimeError: no API"),
        ("def broken(:\n", "SyntaxError: "),
        ("import sys\nsys.exit(3)\n", "SystemExit: 3"),
        (
            "from mogradient_diffusion.rewards import Reward, register_reward\n"
            "@register_reward\nclass Nameless(Reward):\n    pass\n",
            "TypeError: @register_reward: Nameless has no `name`",
        ),
    ],
    ids=["runtime error", "syntax error", "sys.exit", "no name"],
)
def test_a_reward_module_that_raises_on_import_is_one_line(
    tmp_path: Path,
    tiny_pipeline_dir: Path,
    capsys,
    monkeypatch,
    never_load_the_model,
    body,
    message,
) -> None:
    module = f"raising_{abs(hash(body))}"
    (tmp_path / f"{module}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    train = train_arguments(tmp_path / "run", tiny_pipeline_dir, f"reward_modules=[{module}]")
    error = _error_of(train, capsys)
    assert f"reward_modules: importing '{module}' raised {message}" in error
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    evaluate = ["eval", "--model", str(tiny_pipeline_dir), "--prompts", str(prompts)]
    evaluate += ["--metrics", "jpeg_incompressibility", "--out", str(tmp_path / "eval")]
    assert message in _error_of([*evaluate, "--reward-module", module], capsys)


def test_register_reward_names_a_class_without_a_name() -> None:
    class Nameless(Reward):
        pass

    with pytest.raises(TypeError, match="Nameless has no `name`"):
        register_reward(Nameless)


# --- junk given to the checkpoint converters ----------------------------------------------


def _junk(folder: Path, kind: str) -> Path:
    path = folder / "checkpoint.pt"
    if kind == "text":
        path.write_text("my notes, not a checkpoint\n")
    elif kind == "random bytes":
        path.write_bytes(bytes(range(256)) * 16)
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "a list":
        torch.save([1, 2, 3], path)
    elif kind == "a training state":
        torch.save({"step": 3, "weights": torch.ones(2)}, path)
    else:  # another model's state dict
        torch.save({"state_dict": {"encoder.weight": torch.ones(2)}}, path)
    return path


JUNK = ["text", "random bytes", "empty", "a list", "a training state", "another model"]
NOT_LOADABLE = "is not a weights file that PyTorch can load safely"
PROBLEMS = {
    "text": NOT_LOADABLE,
    "random bytes": NOT_LOADABLE,
    "empty": NOT_LOADABLE,
    "a list": "holds an object of type list, not a model's state dict",
    "a training state": "holds a mapping whose entries are not all named tensors",
}


@pytest.mark.parametrize("kind", JUNK)
def test_convert_hps_names_a_file_that_is_no_open_clip_checkpoint(
    tmp_path: Path, kind: str
) -> None:
    checkpoint = _junk(tmp_path, kind)
    problem = PROBLEMS.get(kind, "has no tensor 'logit_scale'")
    with pytest.raises(ValueError) as caught:
        convert_open_clip_checkpoint(checkpoint, tmp_path, tmp_path / "out")
    assert _one_line(str(caught.value)).startswith(f"{checkpoint} {problem}")
    assert str(caught.value).endswith(
        "expected an open_clip CLIP checkpoint such as HPS_v2.1_compressed.pt"
    )


@pytest.mark.parametrize("kind", JUNK)
def test_convert_image_reward_names_a_file_that_is_no_image_reward_checkpoint(
    tmp_path: Path, kind: str
) -> None:
    checkpoint = _junk(tmp_path, kind)
    problem = PROBLEMS.get(kind, "has unknown ImageReward checkpoint keys ['encoder.weight']")
    with pytest.raises(ValueError) as caught:
        convert_image_reward_checkpoint(checkpoint, tmp_path / "out", tmp_path)
    assert _one_line(str(caught.value)).startswith(f"{checkpoint} {problem}")
    assert str(caught.value).endswith("expected the ImageReward.pt released in THUDM/ImageReward")


@pytest.mark.parametrize("command", ["convert-hps", "convert-image-reward"])
def test_the_convert_commands_refuse_junk_in_one_line(tmp_path: Path, capsys, command) -> None:
    checkpoint = _junk(tmp_path, "random bytes")
    error = _error_of([command, str(checkpoint), str(tmp_path), str(tmp_path / "out")], capsys)
    assert error.startswith(f"mogradient-diffusion {command}: {checkpoint} {NOT_LOADABLE}")
    assert not (tmp_path / "out").exists()
