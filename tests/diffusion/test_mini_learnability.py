"""The learnability report's statistics and bookkeeping (no training here)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mogradient_diffusion.mini import learnability


def test_group_statistics_separate_within_from_between_group_spread():
    scores = np.array([[0.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    stats = learnability.group_statistics(np.vstack([scores, np.full((1, 4), np.nan)]))
    assert stats["groups"] == 3 and stats["images"] == 12
    assert stats["share_positive"] == pytest.approx(6 / 12)
    assert stats["zero_std_group_ratio"] == pytest.approx(2 / 3)
    assert stats["within_group_std"] == pytest.approx(np.sqrt(0.25 / 3))
    assert stats["between_group_std"] == pytest.approx(np.std([0.0, 0.5, 1.0]))
    assert learnability.group_statistics(np.full((2, 4), np.nan)) == {"groups": 0}


@pytest.mark.parametrize(
    ("reward", "tags"),
    [
        ("mini_count", {"counting", "general"}),
        ("mini_binding", {"color_attr", "position", "general"}),
        ("mini_ocr", {"text"}),
    ],
)
def test_held_out_prompts_are_those_the_reward_applies_to(reward, tags):
    prompts = learnability.applicable_held_out(reward)
    assert prompts and {p.metadata["tag"] for p in prompts} == tags


def test_per_prompt_scores_skip_metrics_that_do_not_apply(tmp_path):
    rows = [
        {"prompt": "b", "mini_count": 0.5, "mini_count_strict": None},
        {"prompt": "a", "mini_count": 1.0, "mini_count_strict": 1.0},
        {"prompt": "a", "mini_count": 0.0, "mini_count_strict": 0.0},
    ]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    scores = learnability._per_prompt_scores(tmp_path, ["mini_count", "mini_count_strict"])
    assert scores[0].tolist() == [0.5, 0.5]
    assert scores[1, 0] == 0.5 and np.isnan(scores[1, 1])


def test_markdown_lists_every_reward_measured():
    stats = learnability.group_statistics(np.array([[0.0, 1.0], [0.5, 0.5]]))
    report = {
        "machine": "test",
        "base": {"x": {"prompts": 2, "images_per_prompt": 2, "sampling_seconds": 1.0,
                       "rewards": {"mini_count": stats, "mini_ocr": {"groups": 0}}}},
    }  # fmt: skip
    text = learnability.markdown(report)
    assert "| mini_count | 2 | 0.500 | 75% | 50% |" in text and "| mini_ocr | 0 |" in text
