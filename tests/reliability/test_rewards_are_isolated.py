"""A user reward can neither change what the other rewards score nor end training
silently: each gets its own copy of the inputs, and ``sys.exit`` is a reward error."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from mogradient_diffusion.cli import main
from mogradient_diffusion.rewards import Reward, RewardError, RewardSet
from mogradient_diffusion.runs.metrics_log import read_metrics

from .conftest import train_arguments
from .user_rewards import Quitting, Vandal

USER_REWARDS = "reward_modules=[reliability.user_rewards]"


class Brightness(Reward):
    """The mean pixel and the metadata's ``target``: what a vandal would change."""

    name = "brightness"
    value_range = (-math.inf, math.inf)

    def score(self, images, prompts, metadata):
        return images.mean(dim=(1, 2, 3)) + torch.tensor([m["target"] for m in metadata])


def test_a_reward_that_edits_its_inputs_in_place_changes_nothing_for_the_others() -> None:
    images = torch.rand(3, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    metadata = [{"target": float(i)} for i in range(3)]
    alone = RewardSet([Brightness()])(images, ["a", "b", "c"], metadata).values
    after_vandal = RewardSet([Vandal(), Brightness()])(images, ["a", "b", "c"], metadata).values
    torch.testing.assert_close(after_vandal[:, 1], alone[:, 0], rtol=0, atol=0)
    assert images.min() > 0 and metadata[2] == {"target": 2.0}  # the caller's too


def test_sys_exit_in_a_reward_is_a_reward_error_naming_it() -> None:
    with pytest.raises(RewardError, match=r"'quitting' called sys.exit\(0\)"):
        RewardSet([Quitting()])(torch.rand(1, 3, 8, 8), ["a"])


def test_a_reward_calling_sys_exit_stops_training_in_one_line_with_rc_1(
    tmp_path: Path, tiny_pipeline_dir: Path, capsys
) -> None:
    rewards = "rewards=[{name: jpeg_incompressibility}, {name: quitting}]"
    arguments = train_arguments(tmp_path, tiny_pipeline_dir, USER_REWARDS, rewards)
    assert main(arguments) == 1
    error = capsys.readouterr().err
    last = error.strip().splitlines()[-1]
    assert "Traceback" not in error and last.startswith("mogradient-diffusion: training stopped")
    assert "'quitting' called sys.exit(0)" in last
    assert not (tmp_path / "metrics.jsonl").exists() or read_metrics(tmp_path) == []
