"""A reward without signal is warned about; compare refuses incomparable rows and broken
summaries; plot reads a run killed mid-write."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from mogradient_diffusion.cli import main
from mogradient_diffusion.runs.metrics_log import read_metrics

from .conftest import train_arguments
from .test_user_errors import USER_REWARDS


def test_a_reward_with_no_signal_for_an_epoch_is_warned_about(
    tmp_path: Path, tiny_pipeline_dir: Path, capsys
) -> None:
    rewards = "rewards=[{name: jpeg_incompressibility}, {name: never_applies}]"
    arguments = train_arguments(tmp_path, tiny_pipeline_dir, USER_REWARDS, rewards)
    assert main([*arguments, "train.epochs=1"]) == 0
    assert read_metrics(tmp_path)[0]["rewards_without_signal"] == ["never_applies"]
    assert "reward 'never_applies' was NaN" in capsys.readouterr().err


def _evaluation(directory: Path, steps: int, seed: int = 0) -> Path:
    directory.mkdir(parents=True)
    summary = {
        "label": directory.name,
        "metrics": {"ocr": {"mean": 0.5 + steps / 100}},
        "settings": {"prompt_file": "ocr.txt", "steps": steps, "resolution": 512, "seed": seed},
    }
    (directory / "summary.json").write_text(json.dumps(summary))
    return directory


def test_compare_refuses_rows_evaluated_differently_unless_asked(tmp_path: Path, capsys) -> None:
    rows = [str(_evaluation(tmp_path / "a", 40)), str(_evaluation(tmp_path / "b", 10, seed=1))]
    assert main(["compare", *rows]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "steps: a=40, b=10" in error and "seed: a=0, b=1" in error
    assert main(["compare", "--allow-mixed-settings", *rows]) == 0
    assert "different settings" in capsys.readouterr().out


def test_compare_on_a_broken_summary_is_one_line(tmp_path: Path, capsys) -> None:
    good = _evaluation(tmp_path / "good", 40)
    broken = _evaluation(tmp_path / "broken", 40)
    (broken / "summary.json").write_text('{"label": "broken", "metr')
    assert main(["compare", str(good), str(broken)]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "broken/summary.json is not valid JSON" in error


def test_plot_reads_a_run_whose_last_metrics_line_is_torn(
    trained_run: Path, tmp_path: Path, capsys
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copy(trained_run / "metrics.jsonl", run_dir / "metrics.jsonl")
    with open(run_dir / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 2, "reward/color_ma')  # killed mid-write
    assert main(["plot", str(run_dir)]) == 0
    assert (run_dir / "plots" / "rewards.png").is_file()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    (run_dir / "metrics.jsonl").write_text("\n".join([lines[0], "{torn", *lines[1:]]) + "\n")
    assert main(["plot", str(run_dir)]) == 2
    assert "metrics.jsonl:2 is not a JSON record" in capsys.readouterr().err
