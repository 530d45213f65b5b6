"""``plot``: figures a reader can trust (per-reward panels against epochs, marked points),
written where the help says, and a damaged ``metrics.jsonl`` is one line."""

from __future__ import annotations

import json

import pytest

from mogradient import plotting
from mogradient_diffusion.cli import main


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """Each saved figure by file name, kept for inspection."""
    saved: dict[str, object] = {}
    save = plotting._save

    def keep(figure, path):
        saved[str(path).rsplit("/", 1)[-1]] = figure
        return save(figure, path)

    monkeypatch.setattr(plotting, "_save", keep)
    return saved


def _visible_axes(figure) -> list:
    return [axes for axes in figure.axes if axes.get_visible()]


def test_rewards_get_one_panel_each_against_epochs(run_copy, capsys, figures):
    assert main(["plot", str(run_copy)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed[0] == str(run_copy / "plots" / "rewards.png")
    assert all((run_copy / "plots" / name).is_file() for name in ("rewards.png", "weights.png"))

    panels = _visible_axes(figures["rewards.png"])
    assert [axes.get_title() for axes in panels] == ["color_match", "jpeg_incompressibility"]
    for axes in panels:
        assert axes.get_xlabel() == "epoch" and axes.get_ylabel() == "mean reward"
        assert all(float(tick).is_integer() for tick in axes.get_xticks())
        assert axes.get_lines()[0].get_marker() == "o"  # a lone epoch's value still shows
    # One scale per reward: the jpeg panel's range is not stretched to color_match's.
    assert panels[1].get_ylim()[0] > 2.0

    (weights,) = _visible_axes(figures["weights.png"])
    assert all(line.get_marker() == "o" for line in weights.get_lines()[1:6:3])  # every point
    assert all(float(tick).is_integer() for tick in weights.get_xticks())


@pytest.mark.parametrize("content", ["[1, 2]\n", '{"step": 0}\n3\n', '"text"\n{"step": 1}\n'])
def test_a_line_that_is_not_an_object_is_one_line(tmp_path, capsys, content):
    (tmp_path / "metrics.jsonl").write_text(content)
    assert main(["plot", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "Traceback" not in error and "not a JSON object" in error


def test_plot_help_says_what_it_writes_and_eval_help_shows_defaults(capsys):
    for command in ("plot", "eval"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "<run>/plots/" in text and "rewards.png" in text and "weights.png" in text
    assert "else 40)" in text and "else 256)" in text and "(default: auto)" in text


def test_a_record_without_rewards_still_plots_what_it_has(tmp_path, capsys):
    steps = [{"weights": [0.5, 0.5], "harmonize/cos_min": 0.3}]
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "optimizer_steps": steps}))
    assert main(["plot", str(tmp_path)]) == 0
    assert capsys.readouterr().out.split() == [
        str(tmp_path / "plots" / "weights.png"), str(tmp_path / "plots" / "cosines.png")
    ]  # fmt: skip
