"""``compare`` ranks only what can be compared: settings (reward options, sequence length,
dtype among them) must match, and the composite is an effect size against the first row
over the metrics every row has, not a z-score over the compared rows."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from mogradient_diffusion.cli import main
from mogradient_diffusion.evaluation.compare import comparison_table

SETTINGS = {
    "prompt_file": "/prompts/general.txt",
    "max_prompts": None,
    "steps": 40,
    "guidance_scale": 1.0,
    "resolution": 512,
    "max_sequence_length": 256,
    "dtype": "float32",
    "images_per_prompt": 1,
    "seed": 0,
    "metric_options": {},
}


def _entry(mean: float, std: float = 0.2, half_width: float = 0.08) -> dict[str, Any]:
    return {"mean": mean, "std": std, "n": 24, "ci95": [mean - half_width, mean + half_width]}


def _summary(folder: Path, metrics: dict[str, dict], **settings: Any) -> Path:
    folder.mkdir(parents=True)
    summary = {"label": folder.name, "metrics": metrics, "settings": SETTINGS | settings}
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


def _composite(markdown: str, label: str) -> float:
    row = next(line for line in markdown.splitlines() if line.startswith(f"| {label} |"))
    return float(row.split("|")[-2].strip().strip("*").removeprefix("<u>").removesuffix("</u>"))


def test_a_row_with_fewer_metrics_gains_nothing(tmp_path):
    same = {"hps": _entry(0.28), "pickscore": _entry(21.5)}
    full = _summary(tmp_path / "full", same)
    fewer = _summary(tmp_path / "fewer", {"hps": same["hps"]})
    markdown = comparison_table([full, fewer])
    assert _composite(markdown, "full") == _composite(markdown, "fewer") == 0.0
    assert "Not in the composite (missing from a row" in markdown and "pickscore." in markdown


def test_two_close_rows_score_close_and_a_real_gap_is_marked(tmp_path):
    base = _summary(tmp_path / "base", {"jpeg": _entry(3.728)})
    close = _summary(tmp_path / "close", {"jpeg": _entry(3.721)})
    far = _summary(tmp_path / "far", {"jpeg": _entry(3.528)})
    two = comparison_table([base, close])
    assert _composite(two, "close") == pytest.approx(-0.007 / 0.2, abs=1e-3)  # not -0.5
    assert "†" not in two.split("\n\n")[0]  # within the intervals: no mark
    three = comparison_table([base, close, far])
    assert _composite(three, "close") == _composite(two, "close")  # other rows change nothing
    assert _composite(three, "far") == pytest.approx(-1.0, abs=1e-3)
    far_row = next(line for line in three.splitlines() if line.startswith("| far |"))
    assert "3.528†" in far_row


def test_the_composite_pools_the_per_image_std_over_rows(tmp_path):
    a = _summary(tmp_path / "a", {"r": _entry(1.0, std=0.1), "s": _entry(10.0, std=3.0)})
    b = _summary(tmp_path / "b", {"r": _entry(1.2, std=0.3), "s": _entry(13.0, std=5.0)})
    pooled_r, pooled_s = math.sqrt((0.01 + 0.09) / 2), math.sqrt((9 + 25) / 2)
    expected = (0.2 / pooled_r + 3.0 / pooled_s) / 2
    assert _composite(comparison_table([a, b]), "b") == pytest.approx(expected, abs=1e-3)


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ({"metric_options": {"color_match": {"min_share": 0.01}}}, "color_match options"),
        ({"max_sequence_length": 32}, "max_sequence_length"),
        ({"dtype": "bfloat16"}, "dtype"),
    ],
)
def test_rows_evaluated_differently_are_refused_unless_allowed(tmp_path, capsys, setting, named):
    metrics = {"color_match": _entry(0.5)}
    alike = {"metric_options": {"color_match": {"min_share": 0.5}}}
    one = _summary(tmp_path / "one", metrics, **alike)
    other = _summary(tmp_path / "other", metrics, **(alike | setting))
    assert main(["compare", str(one), str(other)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and named in error and "--allow-mixed-settings" in error
    assert main(["compare", str(one), str(other), "--allow-mixed-settings"]) == 0
    assert f"Warning: the rows used different settings: {named}" in capsys.readouterr().out


def test_options_of_a_metric_one_row_lacks_do_not_matter(tmp_path):
    one = _summary(tmp_path / "one", {"a": _entry(1.0)}, metric_options={"a": {"k": 1}})
    other = _summary(tmp_path / "other", {"a": _entry(1.0), "b": _entry(2.0)},
                     metric_options={"a": {"k": 1}, "b": {"k": 2}})  # fmt: skip
    assert "| other |" in comparison_table([one, other])


def test_compare_out_into_a_folder_is_one_line(tmp_path, capsys):
    row = _summary(tmp_path / "row", {"a": _entry(1.0)})
    assert main(["compare", str(row), "--out", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "Traceback" not in error
