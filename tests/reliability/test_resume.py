"""Resume is strict and its record honest: a changed setting is refused unless allowed,
an allowed one really applies, and config.yaml stays the run's first config."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mogradient_diffusion.cli import main
from mogradient_diffusion.model.families.sd3 import SD3
from mogradient_diffusion.runs.checkpoint import latest_checkpoint, load_checkpoint
from mogradient_diffusion.runs.resume import check_resume
from mogradient_diffusion.training_config import ConfigError, load_config

from .conftest import train_arguments


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


def test_a_changed_learning_rate_is_refused_naming_the_key(
    run_copy: Path, tiny_pipeline_dir: Path, capsys, never_load_the_model
) -> None:
    before = (run_copy / "config.yaml").read_text()
    arguments = train_arguments(
        run_copy, tiny_pipeline_dir, "train.epochs=3", "train.learning_rate=0.5"
    )
    assert main(arguments) == 2
    error = _one_line_error(capsys)
    assert "train.learning_rate" in error and "--allow-config-change" in error
    assert "train.epochs (" not in error  # the one setting a resume may change
    assert (run_copy / "config.yaml").read_text() == before


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("lora.rank=8", "lora.rank"),
        ("lora.target_modules=[to_q, to_k]", "lora.target_modules"),
        ("run.seed=1", "run.seed"),
        ("strategy.name=weighted_sum", "strategy.name"),
        ("rewards=[{name: jpeg_incompressibility}]", "rewards"),
    ],
)
def test_settings_the_saved_state_depends_on_never_change(
    trained_run: Path, tiny_pipeline_dir: Path, capsys, never_load_the_model, override, key
) -> None:
    arguments = train_arguments(trained_run, tiny_pipeline_dir, "train.epochs=3", override)
    assert main(["train", "--allow-config-change", *arguments[1:]]) == 2
    error = _one_line_error(capsys)
    assert key in error
    assert f"({trained_run / 'config.yaml'})" in error  # the run's own config, not its parent's


def test_an_allowed_change_reaches_the_optimizer_and_gets_its_own_record(
    run_copy: Path, tiny_pipeline_dir: Path
) -> None:
    first_config = (run_copy / "config.yaml").read_text()
    arguments = train_arguments(
        run_copy, tiny_pipeline_dir, "train.epochs=3", "train.learning_rate=0.5"
    )
    assert main(["train", "--allow-config-change", *arguments[1:]]) == 0
    optimizer = load_checkpoint(latest_checkpoint(run_copy), weights_only=False)["optimizer"]
    assert [group["lr"] for group in optimizer["param_groups"]] == [0.5]
    assert (run_copy / "config.yaml").read_text() == first_config
    record = (run_copy / "resume-1.yaml").read_text()
    assert "# changed train.learning_rate: 0.001 -> 0.5" in record
    assert record.count("# changed") == 1  # the family's LoRA targets are the saved ones
    assert yaml.safe_load(record)["train"]["learning_rate"] == 0.5


def test_the_run_records_the_lora_targets_it_trained(trained_run: Path) -> None:
    """lora.target_modules unset means the family's: config.yaml and the checkpoint name them."""
    saved = yaml.safe_load((trained_run / "config.yaml").read_text())
    assert saved["lora"]["target_modules"] == list(SD3.lora_targets)
    state = load_checkpoint(latest_checkpoint(trained_run), weights_only=False)
    assert state["config"]["lora"]["target_modules"] == list(SD3.lora_targets)


def test_a_run_directory_with_another_config_and_no_checkpoint_starts_again(
    tmp_path: Path, tiny_pipeline_dir: Path, capsys
) -> None:
    """Nothing was trained there (a run that died before its first checkpoint): the new
    config replaces config.yaml, with a note naming what changed (issue 39, item 8)."""
    arguments = train_arguments(tmp_path, tiny_pipeline_dir, "train.learning_rate=0.1")
    other = load_config(preset="tiny", overrides=arguments[3:]).to_dict()
    other["lora"]["target_modules"] = list(SD3.lora_targets)  # a trainer records them
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(other))
    assert main(train_arguments(tmp_path, tiny_pipeline_dir, "train.epochs=1")) == 0
    note = [line for line in capsys.readouterr().err.splitlines() if "no checkpoint" in line]
    assert len(note) == 1 and "train.learning_rate (0.1 -> 0.001)" in note[0]
    assert "nothing was trained" in note[0] and note[0].count(" -> ") == 1
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["train"]["learning_rate"] == 0.001 and latest_checkpoint(tmp_path) is not None


def test_a_run_with_a_checkpoint_still_holds_the_next_command_to_its_config(
    run_copy: Path, tiny_pipeline_dir: Path, capsys, never_load_the_model
) -> None:
    before = (run_copy / "config.yaml").read_text()
    assert main(train_arguments(run_copy, tiny_pipeline_dir, "lora.rank=8")) == 2
    assert "lora.rank (4 -> 8)" in _one_line_error(capsys)
    assert (run_copy / "config.yaml").read_text() == before


def test_the_objective_cannot_change_when_a_run_resumes(tmp_path: Path) -> None:
    saved = load_config(preset="tiny").to_dict()
    other = {**saved, "objective": {**saved["objective"], "name": "sdpo"}}
    with pytest.raises(ConfigError, match=r"objective\.name"):
        check_resume(saved, other, tmp_path, allow_change=True)


def test_a_run_saved_before_the_loggers_resumes_and_may_switch_them() -> None:
    """Older runs' config.yaml has no run.loggers or logger keys; adding or changing them on
    a resume is where the run logs, not what it trains."""
    current = load_config(preset="tiny", overrides=["run.loggers=[jsonl]"]).to_dict()
    saved = load_config(preset="tiny").to_dict()
    for key in ("loggers", "wandb_project", "wandb_mode", "mlflow_tracking_uri"):
        saved["run"].pop(key, None)
    assert check_resume(saved, current, Path("run"), allow_change=False) == {}
    saved_key = {**saved, "run": {**saved["run"], "learning_rate_probe": 1}}
    with pytest.raises(ConfigError, match=r"run\.learning_rate_probe"):  # the check still bites
        check_resume(saved_key, current, Path("run"), allow_change=False)
