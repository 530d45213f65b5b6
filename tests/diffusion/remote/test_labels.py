"""Reward labels: one reward listed twice (two ``remote`` servers) under names of its own,
used for metrics, strategies and checkpoints; without labels, configs and saved runs read
as they always have."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mogradient_diffusion.cli import main
from mogradient_diffusion.config.settings import ConfigError
from mogradient_diffusion.runs.metrics_log import read_metrics
from mogradient_diffusion.training_config import load_config

SERVER = "options: {url: 'http://127.0.0.1:18085', protocol: flow_grpo}"
GENEVAL = f"{{name: remote, label: geneval, {SERVER}}}"
DEQA = f"{{name: remote, label: deqa, {SERVER}}}"


def test_labels_tell_two_remote_rewards_apart_and_are_saved() -> None:
    overrides = [f"rewards=[{GENEVAL}, {DEQA}]", "strategy={name: single, reward: deqa}"]
    config = load_config(preset="tiny", overrides=overrides)
    assert [reward.run_name for reward in config.rewards] == ["geneval", "deqa"]
    saved = config.to_dict()["rewards"]
    assert saved[0] == {
        "name": "remote",
        "label": "geneval",
        "options": {"url": "http://127.0.0.1:18085", "protocol": "flow_grpo"},
    }
    assert load_config(preset="tiny", overrides=[f"rewards={saved}"]).to_dict()["rewards"] == saved


def test_a_config_without_labels_saves_as_before() -> None:
    """Runs saved before labels existed compare equal on resume: no label key unless set,
    and a label equal to the name is the default written out."""
    preset = load_config(preset="tiny").to_dict()["rewards"]
    assert preset == [
        {"name": "color_match", "options": {"min_share": 0.25, "graded": True}},
        {"name": "jpeg_incompressibility", "options": {}},
    ]
    spelled = "rewards=[{name: jpeg_incompressibility, label: jpeg_incompressibility}]"
    config = load_config(preset="tiny", overrides=[spelled])
    assert config.to_dict()["rewards"] == [{"name": "jpeg_incompressibility", "options": {}}]


TWO_REMOTES = (
    "[{name: remote, options: {url: 'http://a'}}, {name: remote, options: {url: 'http://b'}}]"
)


@pytest.mark.parametrize(
    ("rewards", "message"),
    [
        (
            TWO_REMOTES,
            "`rewards:` names ['remote'] more than once: give each entry of the same reward a "
            "label of its own, e.g. {name: remote, label: geneval, options: {...}}",
        ),
        (f"[{GENEVAL}, {GENEVAL}]", "names ['geneval'] more than once"),
        (
            "[{name: color_match}, {name: jpeg_incompressibility, label: color_match}]",
            "names ['color_match'] more than once",
        ),
        (
            "[{name: clip_score}, {name: clipscore}]",
            "lists ['clip_score'] twice under different spellings",
        ),
        (
            "[{name: color_match, label: color/strict}]",
            "config.rewards[0].label must be letters, digits",
        ),
        ("[{name: color_match, label: 3}]", "config.rewards[0].label must be str, got 3"),
        (  # the run's name for the reward, not the registered one (two remotes: which?)
            "[{name: remote, label: geneval, options: {url: 'http://x', nope: 1}}]",
            "reward 'geneval' has no option(s) ['nope']; its options: ['url', ",
        ),
        (
            "[{name: pick_score, label: pick, options: {device: 'bogus:0'}}]",
            "reward 'pick' option device 'bogus:0' is not a device",
        ),
    ],
)
def test_labels_are_checked_in_one_line(rewards: str, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(preset="tiny", overrides=[f"rewards={rewards}"])
    assert message in str(error.value) and "\n" not in str(error.value)


def test_strategies_name_rewards_by_label() -> None:
    overrides = [f"rewards=[{GENEVAL}, {DEQA}]", "strategy={name: single, reward: remote}"]
    with pytest.raises(ConfigError, match=r"reward set to one of \['geneval', 'deqa'\]"):
        load_config(preset="tiny", overrides=overrides)


@pytest.mark.timeout(300)  # trains a tiny run
def test_a_run_keys_everything_by_label_and_resumes_only_with_the_same(
    tmp_path: Path, tiny_pipeline_dir: Path, capsys
) -> None:
    def train(epochs: int, fine: str) -> int:
        coarse = "{name: color_match, label: coarse, options: {min_share: 0.25, graded: true}}"
        other = f"{{name: color_match, label: {fine}, options: {{min_share: 0.1, graded: true}}}}"
        run = [f"model.path={tiny_pipeline_dir}", f"run.directory={tmp_path}", "run.quiet=true"]
        rewards = f"rewards=[{coarse}, {other}]"
        return main(["train", "--preset", "tiny", *run, f"train.epochs={epochs}", rewards])

    assert train(1, "fine") == 0
    record = read_metrics(tmp_path)[0]
    for label in ("coarse", "fine"):
        assert f"reward/{label}/mean" in record and f"time/reward/{label}" in record
        assert f"advantage/{label}/reward_mean" in record
    assert record["objectives"] == ["coarse", "fine"]
    assert not any(key.endswith("/failed") for key in record)  # nothing here can degrade
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())["rewards"]
    assert [entry.get("label") for entry in saved] == ["coarse", "fine"]

    capsys.readouterr()
    assert train(2, "finer") == 2
    line = capsys.readouterr().err.strip()
    assert "was trained with other rewards" in line and "\n" not in line
    assert train(2, "fine") == 0
    assert [record["step"] for record in read_metrics(tmp_path)] == [0, 1]
