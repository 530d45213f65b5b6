"""Every user error is one line, exit 2, before any model loads; a run that fails while
training (a raising reward) stops in one line too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mogradient_diffusion.cli import main
from mogradient_diffusion.training_config import load_config

from .conftest import train_arguments

USER_REWARDS = "reward_modules=[reliability.user_rewards]"


def _one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


def _prompts(directory: Path, content: bytes) -> list[str]:
    (directory / "train.txt").write_bytes(content)
    return [f"prompts.directory={directory}", "prompts.sources=[{name: mine, file: train.txt}]"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["lora.alpha=-3"], "lora.alpha"),
        (["lora.dropout=2"], "lora.dropout"),
        (["train.adam_betas=[0.9, 1.5]"], "train.adam_betas"),
        (["rollout.max_sequence_length=0"], "rollout.max_sequence_length"),
        (["model.device=gpu0"], "model.device"),
        (["rewards=[{name: pickscore, options: {path: /no/such/dir}}]"], "pickscore"),
        (["rewards=[{name: jpeg_incompressibility, options: {quality: 500}}]"], "quality"),
        ("empty", "no prompts"),
        ("latin-1", "not UTF-8"),
        (["run.seed=-5"], "run.seed must be in [0, "),
        (["run.seed=99999999999999999999999"], "run.seed must be in [0, "),
        (["model.device=mps"], "cpu or cuda devices only"),
        (["model.device=meta"], "cpu or cuda devices only"),
        ("weight 0", "weight must be > 0"),
        ("weight -1", "weight must be > 0"),
        ("same names", "repeated: ['mine']"),
    ],
)
def test_user_errors_are_one_line_before_any_model_loads(
    tmp_path: Path, tiny_pipeline_dir: Path, capsys, never_load_the_model, overrides, message
) -> None:
    if overrides == "empty":
        overrides = _prompts(tmp_path, b"\n  \n")
    elif overrides == "latin-1":
        overrides = _prompts(tmp_path, "caf\u00e9 au lait\n".encode("latin-1"))
    elif isinstance(overrides, str) and overrides.startswith("weight"):
        weight = overrides.split()[1]
        overrides = _prompts(tmp_path, b"a cat\n")
        overrides[1] = f"prompts.sources=[{{name: mine, file: train.txt, weight: {weight}}}]"
    elif overrides == "same names":
        overrides = _prompts(tmp_path, b"a cat\n")
        overrides[1] = (
            "prompts.sources=[{name: mine, file: train.txt}, {name: mine, file: train.txt}]"
        )
    run_dir = tmp_path / "run"
    assert main(train_arguments(run_dir, tiny_pipeline_dir, *overrides)) == 2
    assert message in _one_line(capsys.readouterr().err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_asking_for_cuda_without_it_says_so(tmp_path: Path, capsys) -> None:
    arguments = ["train", "--preset", "tiny", f"run.directory={tmp_path}", "model.device=cuda"]
    assert main(arguments) == 2
    assert "CUDA is not available" in _one_line(capsys.readouterr().err)


def test_a_base_cycle_is_one_line(tmp_path: Path, capsys) -> None:
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    assert main(["train", "--config", str(tmp_path / "a.yaml")]) == 2
    assert "cycle" in _one_line(capsys.readouterr().err)


def test_a_float_written_in_yaml_exponent_form_is_a_number(tmp_path: Path) -> None:
    # PyYAML (YAML 1.1) reads 3e-4 as the string "3e-4".
    (tmp_path / "recipe.yaml").write_text("train:\n  learning_rate: 3e-4\n")
    assert load_config(tmp_path / "recipe.yaml", preset="tiny").train.learning_rate == 3e-4


def test_a_raising_reward_stops_training_in_one_line(
    tmp_path: Path, tiny_pipeline_dir: Path, capsys
) -> None:
    rewards = "rewards=[{name: jpeg_incompressibility}, {name: raising}]"
    arguments = train_arguments(tmp_path, tiny_pipeline_dir, USER_REWARDS, rewards)
    assert main(arguments) == 1
    error = capsys.readouterr().err  # the pipeline's loading messages come first
    last = error.strip().splitlines()[-1]
    assert "Traceback" not in error and last.startswith("mogradient-diffusion: training stopped")
    assert "'raising'" in last and "scoring server unreachable" in last


def test_the_largest_seed_trains(tmp_path: Path, tiny_pipeline_dir: Path) -> None:
    seed = f"run.seed={2**63 - 1}"
    assert main(train_arguments(tmp_path, tiny_pipeline_dir, seed, "train.epochs=1")) == 0


def test_a_lora_target_that_matches_nothing_is_one_line_naming_the_layers(
    tmp_path: Path, tiny_pipeline_dir: Path, capsys
) -> None:
    targets = "lora.target_modules=[to_q, x]"
    assert main(train_arguments(tmp_path, tiny_pipeline_dir, targets)) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "Traceback" not in error and "lora.target_modules ['x'] match no module" in error
    assert "to_q" in error and "to_out.0" in error


def test_a_bare_cuda_device_trains_on_this_ranks_gpu(monkeypatch) -> None:
    """``model.device=cuda`` under torchrun: each rank's own GPU, with the index that
    ``torch.cuda.set_device`` needs (a bare ``cuda`` made it raise)."""
    from mogradient_diffusion.training.distributed import World

    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert World.from_environment("cuda").device == torch.device("cuda", 1)
    assert chosen == [torch.device("cuda", 1)]


def test_a_gpu_index_this_machine_lacks_is_a_config_error(monkeypatch) -> None:
    from mogradient_diffusion.training_config import ConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"model.device 'cuda:2'.*cuda:0 to cuda:1"):
        load_config(preset="tiny", overrides=["model.device=cuda:2"])
