"""``eval --steps-sweep`` on the tiny pipeline: one evaluation per step count and a table
by count, reached from the command line; bad sweeps are one clear line before any model loads.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mogradient_diffusion.cli import main

METRICS = ("jpeg_incompressibility", "jpeg_compressibility")


def run_sweep(model: Path, out: Path, *sweep: str) -> int:
    return main(
        ["eval", "--model", str(model), "--out", str(out), "--quiet", "--prompts", "general",
         "--metrics", ",".join(METRICS), "--max-prompts", "2", "--images-per-prompt", "1",
         "--max-sequence-length", "32", "--device", "cpu", *sweep]
    )  # fmt: skip


def test_bare_steps_sweep_tabulates_sdpos_step_counts(tiny_pipeline_dir, tmp_path, capsys):
    out = tmp_path / "base"
    assert run_sweep(tiny_pipeline_dir, out, "--steps-sweep") == 0
    printed = capsys.readouterr().out
    assert str(out / "few_steps.md") in printed and str(out / "few_steps.json") in printed

    table = json.loads((out / "few_steps.json").read_text())
    assert table["label"] == "base" and table["metrics"] == list(METRICS)
    assert list(table["steps"]) == ["1", "2", "4", "8", "16"]
    for count, values in table["steps"].items():
        summary = json.loads((out / f"steps_{int(count):02d}" / "summary.json").read_text())
        assert summary["settings"]["steps"] == int(count)
        for name in METRICS:
            entry = values[name]
            assert entry["n"] == 2 and math.isfinite(entry["mean"])
            assert all(math.isfinite(bound) for bound in entry["ci95"])
            assert entry["mean"] == summary["metrics"][name]["mean"]
    markdown = (out / "few_steps.md").read_text()
    assert markdown in printed  # the table is printed as well as written
    assert [line.split("|")[1].strip() for line in markdown.splitlines()[4:]] == [
        "1", "2", "4", "8", "16"
    ]  # fmt: skip


@pytest.mark.parametrize("sweep", ["0,1", "1,,2", "a", "1.5", "-1", "2,2", "1, 2 ,x"])
def test_bad_steps_sweep_is_one_clear_line(tiny_pipeline_dir, tmp_path, capsys, sweep):
    assert run_sweep(tiny_pipeline_dir, tmp_path / "out", f"--steps-sweep={sweep}") == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "Traceback" not in error
    assert "--steps-sweep" in error and repr(sweep) in error
    assert not (tmp_path / "out").exists()  # refused before anything ran


def test_steps_and_steps_sweep_are_exclusive(tiny_pipeline_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        run_sweep(tiny_pipeline_dir, tmp_path / "out", "--steps", "4", "--steps-sweep", "1,2")
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert "not allowed with argument --steps" in error and "Traceback" not in error
