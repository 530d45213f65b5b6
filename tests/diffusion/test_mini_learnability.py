"""The learnability report's statistics and bookkeeping (no training here)."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # benchmarks/ is not installed; `python -m pytest` adds it too
    sys.path.insert(0, str(ROOT))

from benchmarks.mini import learnability  # noqa: E402


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
        ("mini_sign", {"text"}),
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


def _check(specialist: float, control: float, base: float = 0.2) -> dict:
    return {"metrics": {"r": {"base": base, "specialist": specialist, "control": control}}}


def test_acceptance_needs_both_a_fifth_of_the_headroom_and_two_seed_std():
    # Gains 0.22, 0.20, 0.24 over base 0.2: mean 0.42 - 0.2 = 0.22 = 27.5% of 0.8.
    passing = [_check(0.42, 0.20), _check(0.40, 0.22), _check(0.44, 0.18)]
    verdict = learnability.acceptance(passing, "r")
    pooled = np.sqrt((np.var([0.42, 0.40, 0.44], ddof=1) + np.var([0.2, 0.22, 0.18], ddof=1)) / 2)
    assert verdict["gain_share_of_headroom"] == pytest.approx(0.22 / 0.8)
    assert verdict["separation_in_seed_std"] == pytest.approx(0.22 / pooled)
    assert verdict["passed"]
    small = [_check(0.30, 0.20), _check(0.31, 0.21), _check(0.29, 0.19)]  # 12% of headroom
    assert not learnability.acceptance(small, "r")["passed"]
    noisy = [_check(0.9, 0.2), _check(0.2, 0.2), _check(0.2, 0.9)]  # big mean, seed noise
    assert learnability.acceptance(noisy, "r")["gain_share_of_headroom"] >= 0.2
    assert not learnability.acceptance(noisy, "r")["passed"]
    assert not learnability.acceptance(passing[:1], "r")["passed"]  # one seed: no std


def test_markdown_reports_the_acceptance_verdicts():
    verdict = learnability.acceptance([_check(0.42, 0.2), _check(0.4, 0.22)], "r")
    report = {"machine": "test", "acceptance": {"seeds": 2, "epochs": 40, "overrides": [],
                                               "rewards": {"r": verdict}}}  # fmt: skip
    text = learnability.markdown(report)
    assert "## Acceptance test (2 seeds, 40 epochs" in text
    assert "| r | 0.200 | 0.420 0.400 | 0.200 0.220 | +26% |" in text


class FakeCli:
    """Stands in for the CLI children: writes what each command would, records evaluations."""

    def __init__(self, base_seconds: float = 0.0):
        self.evaluated: list[str] = []
        self.base_seconds = base_seconds  # a slow base evaluation invites races
        self.lock = threading.Lock()

    def __call__(self, command: list[str], log: Path) -> float:
        if command[3] == "eval":
            label = command[command.index("--label") + 1]
            time.sleep(self.base_seconds if label == "base" else 0.0)
            with self.lock:
                self.evaluated.append(label)
            out = Path(command[command.index("--out") + 1])
            out.mkdir(parents=True, exist_ok=True)
            score = {"base": 0.1, "specialist": 0.5, "control": 0.2}[label]
            rows = [{"prompt": p, "mini_count": score, "mini_count_strict": 0.0} for p in "ab"]
            (out / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            (out / "summary.json").write_text("{}")
        else:
            run_dir = Path(next(a for a in command if a.startswith("run.directory=")).split("=")[1])
            (run_dir / "lora").mkdir(parents=True)
            (run_dir / "metrics.jsonl").write_text("")
        return 1.0


def test_checks_sharing_base_work_evaluate_the_base_model_once(tmp_path, monkeypatch):
    cli = FakeCli()
    monkeypatch.setattr(learnability, "_run", cli)
    for seed in (0, 1):
        learnability.specialist_check(
            "mini_count", tmp_path / f"s{seed}", tmp_path, 1, seed, 1, base_work=tmp_path
        )
    assert cli.evaluated == ["base", "specialist", "control", "specialist", "control"]


def test_concurrent_acceptance_checks_evaluate_the_base_once(tmp_path, monkeypatch):
    cli = FakeCli(base_seconds=0.2)
    monkeypatch.setattr(learnability, "_run", cli)
    argv = ["acceptance", "--rewards", "mini_count", "--seeds", "3", "--workers", "3"]
    learnability.main([*argv, "--out", str(tmp_path), "--model", str(tmp_path)])
    assert sorted(cli.evaluated) == ["base"] + ["control"] * 3 + ["specialist"] * 3
    verdict = json.loads((tmp_path / "learnability.json").read_text())["acceptance"]
    count = verdict["rewards"]["mini_count"]
    assert count["specialist"] == [0.5] * 3 and count["curves"] == [[], [], []]
    assert count["held_out"]["mini_count_strict"]["specialist"] == [0.0] * 3
    report = (tmp_path / "learnability.md").read_text()
    assert "- mini_count -> mini_count_strict: base 0.000, specialist 0.000 0.000 0.000" in report
