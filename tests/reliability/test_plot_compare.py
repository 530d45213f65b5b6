"""``plot RUN RUN --out DIR``: runs compared in one figure each, a line per run (the union
of their rewards), solve and cached steps told apart, and unmeasured steps said."""

from __future__ import annotations

from pathlib import Path

import pytest
from matplotlib.collections import PolyCollection
from PIL import Image

from mogradient import plotting
from mogradient_diffusion.cli import main
from mogradient_diffusion.runs.plots import value_range

from .conftest import train_arguments
from .test_plot_run import _visible_axes, figures  # noqa: F401  (the fixture)


@pytest.fixture(scope="module")
def scalar_run(tiny_pipeline_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-epoch weighted-sum run on another reward set, in a folder named like ``trained_run``."""
    run_dir = tmp_path_factory.mktemp("scalar") / "run"
    rewards = '[{"name": "color_match"}, {"name": "jpeg_compressibility"}]'
    arguments = train_arguments(
        run_dir, tiny_pipeline_dir, "strategy.name=weighted_sum", f"rewards={rewards}"
    )
    assert main(arguments) == 0
    return run_dir


@pytest.fixture
def compared(trained_run, scalar_run, tmp_path, figures, capsys):  # noqa: F811
    """Both runs plotted into one folder: the figures by file name, the folder, the paths
    printed."""
    assert main(["plot", str(trained_run), str(scalar_run), "--out", str(tmp_path / "cmp")]) == 0
    return figures, tmp_path / "cmp", capsys.readouterr().out.split()


def test_several_runs_share_each_figure_with_a_line_per_run(compared):
    figures, out, printed = compared  # noqa: F811
    assert printed == [str(out / name) for name in (
        "rewards.png", "weights.png", "cosines.png")]  # fmt: skip
    with Image.open(out / "rewards.png") as image:  # three panels: one row, 4 columns wide
        assert image.size == (int(3.6 * 3 * 100 + 80), int((3.0 + 0.85 + 0.35) * 100))
    panels = {axes.get_title(): axes for axes in _visible_axes(figures["rewards.png"])}
    lines = {
        title: [line.get_label() for line in axes.get_lines()] for title, axes in panels.items()
    }
    # folder names collide ("run"): each run is labelled by its strategy
    assert lines == {
        "color_match": ["marble", "weighted_sum"],
        "jpeg_incompressibility": ["marble"],
        "jpeg_compressibility": ["weighted_sum"],
    }


def test_a_zero_to_one_rewards_band_stays_in_its_range(compared):
    figures, _, _ = compared  # noqa: F811
    (color,) = [a for a in _visible_axes(figures["rewards.png"]) if a.get_title() == "color_match"]
    bands = [c for c in color.collections if isinstance(c, PolyCollection)]
    assert bands and all(b.get_paths()[0].vertices[:, 1].min() >= 0 for b in bands)
    assert max(b.get_paths()[0].vertices[:, 1].max() for b in bands) <= 1
    assert value_range("color_match") == (0.0, 1.0)
    assert value_range("pickscore") is None  # an alias; its range depends on the model
    assert value_range("a_user_reward") is None


def test_weights_mark_solve_steps_and_say_when_there_is_one_objective(compared):
    figures, _, _ = compared  # noqa: F811
    marble, scalar = _visible_axes(figures["weights.png"])
    assert (marble.get_title(), scalar.get_title()) == ("marble", "weighted_sum")
    legend = [text.get_text() for text in figures["weights.png"].legends[0].get_texts()]
    assert "solve step" in legend and "cached step" in legend
    lines = marble.get_lines()  # per objective: the line, solve steps, cached steps
    # the tiny preset's MARBLE (period 2) solves on steps 0 and 2 and reuses on 1 and 3
    assert [len(line.get_xdata()) for line in lines[1:6:3]] == [2, 2]
    assert [len(line.get_xdata()) for line in lines[2:6:3]] == [2, 2]
    assert [text.get_text() for text in scalar.texts] == [plotting.ONE_OBJECTIVE]
    assert not scalar.get_lines()


def test_cosines_say_how_many_steps_were_measured(compared):
    figures, out, _ = compared  # noqa: F811
    (axes,) = _visible_axes(figures["cosines.png"])
    title = axes.get_title()
    assert "set run.conflict_probe=true to measure every step" in title
    assert "weighted_sum: 0 of 4 steps measured" in title
    assert "marble: 2 of 4 steps measured" in title  # its cached steps, without the probe
    assert Image.open(out / "cosines.png").size == (600, 440)


def test_several_runs_need_out_and_a_run_given_twice_is_refused(trained_run, capsys):
    assert main(["plot", str(trained_run), str(trained_run)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "--out DIR" in error
    assert main(["plot", str(trained_run), str(trained_run), "--out", "x"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "given twice" in error
