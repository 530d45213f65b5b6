"""What a newcomer's first tiny run shows: every reward of the preset applies to the
built-in prompts, the progress bar names what each weight belongs to, and no library
notice about torchvision (which does not work with the pinned torch) is printed."""

from __future__ import annotations

import subprocess
import sys

from mogradient_diffusion.prompts.stream import BUILT_IN_SOURCES
from mogradient_diffusion.rewards import colors_in_prompt
from mogradient_diffusion.training.records import progress_summary
from mogradient_diffusion.training_config import load_config


def test_every_built_in_prompt_names_a_colour_for_the_tiny_presets_color_match() -> None:
    assert "color_match" in [reward.name for reward in load_config(preset="tiny").rewards]
    for source in BUILT_IN_SOURCES:
        for prompt in source.prompts:
            assert colors_in_prompt(prompt), prompt


def test_the_progress_bar_puts_each_weight_beside_its_reward() -> None:
    record = {
        "reward/color_match/mean": 0.1875,
        "reward/jpeg/mean": 3.72,
        "optimizer_steps": [{"weights": [0.0, 1.0]}, {"weights": [1.1, 0.32]}],
    }
    assert progress_summary(record, ["color_match", "jpeg"]) == {
        "color_match": "0.188 (weight 1.1)",
        "jpeg": "3.72 (weight 0.32)",
    }


def test_a_single_objective_shows_no_weight() -> None:
    record = {"reward/a/mean": 1.0, "reward/b/mean": 2.0, "optimizer_steps": [{"weights": [1]}]}
    assert progress_summary(record, ["a", "b"]) == {"a": "1", "b": "2"}


def test_importing_the_sd3_pipeline_prints_no_torchvision_notice() -> None:
    code = "import mogradient_diffusion.cli; from diffusers import StableDiffusion3Pipeline"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "torchvision" not in result.stderr + result.stdout
