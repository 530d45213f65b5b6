"""What ``eval`` leaves in ``--out``: a rerun replaces the previous evaluation whole (no
stale image), a failed one leaves it untouched, one value is no interval (not NaN), and
the grid carries each image's prompt and scores."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFont

from mogradient_diffusion.cli import main
from mogradient_diffusion.evaluation.evaluate import summarize, summary_markdown
from mogradient_diffusion.evaluation.few_step import few_steps_markdown
from mogradient_diffusion.evaluation.grid import FONT_SIZE, TILE, caption_lines, save_grid


def _eval(model: Path, out: Path, prompts: int) -> int:
    return main(
        ["eval", "--model", str(model), "--prompts", "general", "--metrics",
         "jpeg_incompressibility", "--max-prompts", str(prompts), "--steps", "1",
         "--max-sequence-length", "32", "--quiet", "--out", str(out)]
    )  # fmt: skip


def test_a_rerun_replaces_the_evaluation_and_keeps_other_files(
    tiny_pipeline_dir, tmp_path, monkeypatch
):
    out = tmp_path / "out"
    assert _eval(tiny_pipeline_dir, out, 3) == 0
    (out / "notes.txt").write_text("mine")
    before = (out / "samples.jsonl").read_text()

    def fail(*args, **kwargs):
        raise RuntimeError("out of memory")

    with monkeypatch.context() as patch:  # a run that dies midway changes nothing
        patch.setattr("mogradient_diffusion.evaluation.evaluate.generate", fail)
        with pytest.raises(RuntimeError):
            _eval(tiny_pipeline_dir, out, 1)
    assert (out / "samples.jsonl").read_text() == before
    assert len(list((out / "images").iterdir())) == 3
    assert not (out / ".eval-in-progress").exists()
    with monkeypatch.context() as patch:  # nor does it leave a folder it created
        patch.setattr("mogradient_diffusion.evaluation.evaluate.generate", fail)
        with pytest.raises(RuntimeError):
            _eval(tiny_pipeline_dir, tmp_path / "new", 1)
    assert not (tmp_path / "new").exists()

    assert _eval(tiny_pipeline_dir, out, 1) == 0
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert sorted(path.name for path in (out / "images").iterdir()) == ["00000.png"]
    assert [row["image"] for row in rows] == ["images/00000.png"]
    assert (out / "notes.txt").read_text() == "mine"
    assert sorted(path.name for path in out.iterdir()) == [
        "grid.png", "images", "notes.txt", "samples.jsonl", "summary.json", "summary.md"
    ]  # fmt: skip


def test_one_value_has_no_interval_rather_than_nan():
    rows = [{"tag": None, "m": 0.5}, {"tag": None, "m": None}]
    summary = summarize(rows, ["m"])
    entry = summary["metrics"]["m"]
    assert entry["n"] == 1 and entry["ci95"] == [None, None] and entry["std"] is None
    assert "NaN" not in json.dumps(summary)  # NaN is no JSON
    settings = {"model": "m", "lora": None, "prompts": "p", "steps": 1, "guidance_scale": 1.0}
    markdown = summary_markdown(summary | {"label": "x", "settings": settings | {"seed": 0}})
    assert "| m | 0.5000 | n/a (n=1) | n/a | 1 | 1 |" in markdown and "nan" not in markdown
    table = {"label": "x", "metrics": ["m"], "steps": {"1": {"m": entry}}}
    assert "| 1 | 0.5000 n/a (n=1) |" in few_steps_markdown(table)


def test_grid_captions_each_image_with_its_prompt_and_scores(tmp_path):
    (tmp_path / "images").mkdir()
    rows = []
    for index in range(5):
        image = f"images/{index:05d}.png"
        Image.new("RGB", (64, 64), (0, 0, 255)).save(tmp_path / image)
        prompt = "a cat" if index else "a very long prompt " * 10
        rows.append({"prompt": prompt, "image": image, "ocr": 0.25 * index, "clip": None})
    save_grid(rows, ["ocr", "clip"], tmp_path, tmp_path / "grid.png")
    grid = np.asarray(Image.open(tmp_path / "grid.png").convert("RGB")).astype(int)
    assert grid.shape[1] > 4 * TILE and grid.shape[0] > 2 * TILE
    below_first = grid[TILE : TILE + 3 * (FONT_SIZE + 4), :TILE]
    assert (below_first.sum(axis=2) < 200).any()  # dark caption text under the image

    font = ImageFont.load_default(size=FONT_SIZE)
    lines = caption_lines(rows[1], ["ocr", "clip"], font, TILE)
    assert lines == ["a cat", "ocr 0.25", "clip n/a"]
    long = caption_lines(rows[0], ["ocr"], font, TILE)[0]
    assert long.endswith("...") and font.getlength(long) <= TILE


class _CountingFont:
    """A font that counts its measurements."""

    def __init__(self, font) -> None:
        self.font, self.calls = font, 0

    def getlength(self, text: str) -> float:
        self.calls += 1
        return self.font.getlength(text)


def test_a_long_caption_is_cut_with_few_measurements_to_the_longest_fitting_prefix() -> None:
    """A 36,000-character prompt was cut one character at a time, each time re-measured
    (34 s for 8,000 characters): now O(log n) measurements, the same answer as that loop."""
    from mogradient_diffusion.evaluation.grid import fit

    font = _CountingFont(ImageFont.load_default(size=FONT_SIZE))
    generator = np.random.default_rng(0)
    words = ["a", "cat", "WWW", "iii", "photo", "of", "red", "signs"]
    for length in (1, 5, 40, 200):
        text = " ".join(generator.choice(words, size=length))
        expected = text  # the longest prefix that fits with "...", by brute force
        if font.font.getlength(text) > TILE:
            fitting = [n for n in range(len(text)) if font.font.getlength(text[:n] + "...") <= TILE]
            expected = text[: max(fitting, default=0)].rstrip() + "..."
        assert fit(text, font, TILE) == expected
    font.calls = 0
    long_text = "word " * 7200  # 36,000 characters
    assert fit(long_text, font, TILE).endswith("...")
    assert font.calls <= 20
