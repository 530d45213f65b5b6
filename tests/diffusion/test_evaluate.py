"""Evaluation and comparison: the tiny pipeline end to end (generation with a LoRA, offline
and model-based metrics, files written), fixed seeds, summaries, the Table-1 composite."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mogradient_diffusion.cli import main
from mogradient_diffusion.evaluation.compare import comparison_table, composite_scores
from mogradient_diffusion.evaluation.evaluate import (
    PROMPT_SETS,
    EvalSettings,
    bootstrap_interval,
    load_eval_prompts,
    resolve_prompt_set,
    summarize,
)
from mogradient_diffusion.evaluation.grid import GAP, TILE
from mogradient_diffusion.model.policy import LoraSpec, Policy
from mogradient_diffusion.rewards import RewardSet

from .reward_models import save_tiny_clip


@pytest.fixture(scope="module")
def lora_dir(tiny_pipeline_dir, tmp_path_factory) -> Path:
    policy = Policy.load(tiny_pipeline_dir, LoraSpec(rank=4, alpha=8))
    generator = torch.Generator().manual_seed(0)
    for parameter in policy.trainable_parameters():
        parameter.data = torch.randn(parameter.shape, generator=generator) * 0.5
    return policy.save_lora(tmp_path_factory.mktemp("lora"))


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory) -> Path:
    return save_tiny_clip(tmp_path_factory.mktemp("clip"))


def run_eval(out: Path, model: Path, *extra: str) -> int:
    return main(
        ["eval", "--model", str(model), "--out", str(out), "--quiet", "--steps", "2", *extra]
    )


def test_eval_writes_images_jsonl_summary_and_grid(tiny_pipeline_dir, lora_dir, clip_dir, tmp_path):
    out = tmp_path / "tuned"
    code = run_eval(
        out, tiny_pipeline_dir, "--lora", str(lora_dir), "--prompts", "ocr",
        "--metrics", "ocr,jpeg_compressibility,clipscore",
        "--metric-option", f"clipscore.path={clip_dir}",
        "--max-prompts", "3", "--images-per-prompt", "2", "--batch-size", "4",
    )  # fmt: skip
    assert code == 0
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [row["index"] for row in rows] == list(range(6))
    assert [row["prompt_index"] for row in rows] == [0, 0, 1, 1, 2, 2]
    assert len({row["seed"] for row in rows}) == 6
    for row in rows:
        assert Image.open(out / row["image"]).size == (64, 64)
        assert 0 <= row["ocr"] <= 1 and row["jpeg_compressibility"] <= 0
        assert -1 <= row["clipscore"] <= 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["images"] == 6 and summary["label"] == "tuned"
    for name in ("ocr", "jpeg_compressibility", "clipscore"):
        entry = summary["metrics"][name]
        assert entry["n"] == 6 and math.isfinite(entry["mean"])
        assert entry["mean"] == pytest.approx(np.mean([row[name] for row in rows]))
    assert summary["settings"]["steps"] == 2 and summary["settings"]["guidance_scale"] == 1.0
    assert "| clipscore |" in (out / "summary.md").read_text()
    width, height = Image.open(out / "grid.png").size  # 6 images: 4 tiles a row, 2 rows
    assert width == 4 * TILE + 3 * GAP and 2 * TILE < height < 3 * TILE

    # Same seeds, another batch size: the same images; without the LoRA: other images.
    again = tmp_path / "again"
    assert run_eval(again, tiny_pipeline_dir, "--lora", str(lora_dir), "--prompts", "ocr",
                    "--metrics", "jpeg_compressibility", "--max-prompts", "3",
                    "--images-per-prompt", "2", "--batch-size", "1") == 0  # fmt: skip
    base = tmp_path / "base"
    assert run_eval(base, tiny_pipeline_dir, "--prompts", "ocr", "--metrics",
                    "jpeg_compressibility", "--max-prompts", "3",
                    "--images-per-prompt", "2") == 0  # fmt: skip
    for index in range(6):
        tuned = np.asarray(Image.open(out / f"images/{index:05d}.png"), dtype=int)
        rebatched = np.asarray(Image.open(again / f"images/{index:05d}.png"), dtype=int)
        untuned = np.asarray(Image.open(base / f"images/{index:05d}.png"), dtype=int)
        assert np.abs(tuned - rebatched).max() <= 1
        assert np.abs(tuned - untuned).max() > 10

    assert main(["compare", str(out), str(base), "--out", str(tmp_path / "table.md")]) == 0
    table = (tmp_path / "table.md").read_text()
    assert "| tuned |" in table and "| base |" in table and "composite" in table


def test_geneval_metadata_reaches_the_rewards_and_summaries_group_by_tag():
    source = load_eval_prompts(EvalSettings(model="m", prompts="geneval", metrics=["x"], out="o"))
    tags = {item["tag"] for item in source.metadata}
    assert tags == {"single_object", "two_object", "counting", "colors", "position", "color_attr"}
    rows = [
        {"tag": "a", "m": 1.0},
        {"tag": "a", "m": 0.0},
        {"tag": "b", "m": 1.0},
        {"tag": "b", "m": None},  # not applicable
    ]
    entry = summarize(rows, ["m"])["metrics"]["m"]
    assert entry["n"] == 3 and entry["not_applicable"] == 1
    assert entry["mean"] == pytest.approx(2 / 3)
    assert entry["by_tag"] == {"a": 0.5, "b": 1.0}
    assert entry["mean_over_tags"] == pytest.approx(0.75)


def test_bootstrap_interval_brackets_the_mean_and_narrows_with_n():
    rng = np.random.default_rng(1)
    small, large = rng.normal(size=20), rng.normal(size=2000)
    low, high = bootstrap_interval(small)
    assert low < small.mean() < high
    low_l, high_l = bootstrap_interval(large)
    assert high_l - low_l < (high - low) / 5
    # ~ mean +- 1.96 sd / sqrt(n) for a large normal sample
    assert high_l - low_l == pytest.approx(2 * 1.96 * large.std() / np.sqrt(2000), rel=0.15)
    assert all(math.isnan(v) for v in bootstrap_interval(np.array([1.0])))


def test_every_shipped_prompt_set_loads():
    for name in PROMPT_SETS:
        assert resolve_prompt_set(name).is_file()
        source = load_eval_prompts(EvalSettings(model="m", prompts=name, metrics=["x"], out="o"))
        assert len(source) >= 10
    ocr = load_eval_prompts(EvalSettings(model="m", prompts="ocr", metrics=["x"], out="o"))
    assert all(prompt.count('"') == 2 for prompt in ocr.prompts)


def test_z_score_composite_by_hand_and_compare_marks_best_and_second(tmp_path):
    """``composite_scores`` is the miniature report's; ``compare`` ranks by effect size
    (tests/reliability/test_compare_composite.py) and needs a per-image std for it."""
    values = {"a": {"r1": 1.0, "r2": 10.0}, "b": {"r1": 2.0, "r2": 30.0}, "c": {"r1": 3.0}}
    for label, metrics in values.items():
        (tmp_path / label).mkdir()
        summary = {"label": label, "metrics": {m: {"mean": v} for m, v in metrics.items()}}
        (tmp_path / label / "summary.json").write_text(json.dumps(summary))
    # r1: mean 2, population std sqrt(2/3); r2 (a, b only): mean 20, std 10.
    s = math.sqrt(2 / 3)
    expected = [(-1 / s + -1) / 2, (0 + 1) / 2, 1 / s]
    table = [{m: values[k].get(m, math.nan) for m in ("r1", "r2")} for k in "abc"]
    assert composite_scores(table, ["r1", "r2"]) == pytest.approx(expected)
    markdown = comparison_table([tmp_path / k for k in "abc"])
    row_c = next(line for line in markdown.splitlines() if line.startswith("| c |"))
    assert row_c == "| c | **3.000** | – | – |"  # no std in these summaries: no composite
    assert "Composite: none" in markdown
    row_b = next(line for line in markdown.splitlines() if line.startswith("| b |"))
    assert "<u>2.000</u>" in row_b and "**30.000**" in row_b


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompts", "ocr", "--metrics", "nope"], "unknown metrics"),
        (["--prompts", "missing.txt", "--metrics", "ocr"], "neither a shipped set"),
        (["--prompts", "ocr", "--metrics", "ocr", "--steps", "0"], "steps"),
        (["--prompts", "ocr", "--metrics", "pick_score"], "pick_score"),
    ],
)
def test_bad_eval_input_is_one_clear_line(tiny_pipeline_dir, tmp_path, capsys, args, message):
    assert run_eval(tmp_path / "out", tiny_pipeline_dir, *args) == 2
    error = capsys.readouterr().err
    assert message in error and "Traceback" not in error


def test_eval_closes_its_rewards(tiny_pipeline_dir, tmp_path, monkeypatch):
    """A remote reward's connections and threads end with the evaluation."""
    closed = []
    monkeypatch.setattr(RewardSet, "close", lambda self: closed.append(self.names))
    args = ["--prompts", "ocr", "--metrics", "jpeg_compressibility", "--max-prompts", "1"]
    assert run_eval(tmp_path / "out", tiny_pipeline_dir, *args, "--images-per-prompt", "1") == 0
    assert closed == [("jpeg_compressibility",)]


def test_compare_without_summary_names_the_folder(tmp_path, capsys):
    assert main(["compare", str(tmp_path)]) == 2
    assert "no summary.json" in capsys.readouterr().err
