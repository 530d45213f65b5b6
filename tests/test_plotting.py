"""Each plot function writes a non-empty PNG; bad input and a missing matplotlib fail clearly."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from benchmarks.toys import plots as toy_plots
from benchmarks.toys.problems import Trajectory, cagrad_toy, optimize_starts, triangle_quadratics
from mogradient import plotting
from mogradient.harmonizers import MGDA, Mean

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def toy_runs() -> dict[str, list[Trajectory]]:
    problem = cagrad_toy()
    return {
        name: optimize_starts(problem, factory, problem.starts[:3], steps=12, lr=0.05)
        for name, factory in {"mgda": MGDA, "mean": Mean}.items()
    }


def assert_png(path: Path) -> None:
    assert path.is_file()
    assert path.stat().st_size > 1000
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_cosine_distributions(tmp_path: Path, toy_runs: dict[str, list[Trajectory]]) -> None:
    cosines = {name: torch.cat([run.cos_min() for run in runs]) for name, runs in toy_runs.items()}
    # Degenerate inputs: constant values (no KDE possible) and nothing finite at all.
    cosines["constant"] = torch.ones(5)
    cosines["stationary"] = torch.full((5,), float("nan"))
    path = plotting.plot_cosine_distributions(cosines, tmp_path / "cos.png")
    assert path == tmp_path / "cos.png"
    assert_png(path)


def test_weight_trajectories(tmp_path: Path, toy_runs: dict[str, list[Trajectory]]) -> None:
    weights = {name: [run.weights for run in runs] for name, runs in toy_runs.items()}
    assert_png(plotting.plot_weight_trajectories(weights, tmp_path / "nested" / "weights.png"))


def test_loss_curves(tmp_path: Path, toy_runs: dict[str, list[Trajectory]]) -> None:
    losses = {name: [run.losses for run in runs] for name, runs in toy_runs.items()}
    path = plotting.plot_loss_curves(losses, tmp_path / "losses.png", objective_names=["a", "b"])
    assert_png(path)


def test_metric_panels(tmp_path: Path) -> None:
    # Two scales, a lone finite value between gaps and a series with none at all.
    series = {"a": [1.0, 1.1, 1.2], "b": [float("nan"), 3.7, float("nan")], "c": [float("nan")] * 3}
    path = plotting.plot_metric_panels(
        series, tmp_path / "m.png", "metrics", x=[0, 1, 2], xlabel="epoch",
        spread={"a": [0.1, 0.1, 0.1]},
    )  # fmt: skip
    assert_png(path)


def test_objective_space(tmp_path: Path, toy_runs: dict[str, list[Trajectory]]) -> None:
    assert_png(toy_plots.plot_objective_space(cagrad_toy(), toy_runs, tmp_path / "objective.png"))


def test_parameter_space(tmp_path: Path, toy_runs: dict[str, list[Trajectory]]) -> None:
    problem = cagrad_toy()
    assert_png(toy_plots.plot_parameter_space(problem, toy_runs, tmp_path / "params.png"))
    plain = toy_plots.plot_parameter_space(problem, toy_runs, tmp_path / "plain.png", contour=False)
    assert_png(plain)


def test_trajectory_plots_check_the_problem_shape(
    tmp_path: Path, toy_runs: dict[str, list[Trajectory]]
) -> None:
    with pytest.raises(ValueError, match="2 objectives"):
        toy_plots.plot_objective_space(triangle_quadratics(), toy_runs, tmp_path / "x.png")
    with pytest.raises(ValueError, match="no methods"):
        plotting.plot_loss_curves({}, tmp_path / "x.png")


def test_missing_matplotlib_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install 'mogradient\[plot\]'"):
        plotting.plot_cosine_distributions({"mgda": [0.5]}, tmp_path / "x.png")


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> list:
    """Each saved figure, kept for inspection."""
    saved: list = []
    save = plotting._save
    monkeypatch.setattr(plotting, "_save", lambda f, p: saved.append(f) or save(f, p))
    return saved


def test_per_step_tensors_are_stacked_and_ragged_ones_refused(tmp_path: Path) -> None:
    steps = [torch.tensor([0.5, 0.5]), torch.tensor([0.2, 0.8])]
    assert_png(plotting.plot_weight_trajectories({"m": [steps]}, tmp_path / "w.png"))
    assert_png(plotting.plot_loss_curves({"m": [steps]}, tmp_path / "l.png"))
    ragged = [torch.tensor([0.5, 0.5]), torch.tensor([0.2, 0.3, 0.5])]
    with pytest.raises(ValueError, match=r"^weights\['m'\]\[0\]: .*lengths \[2, 3\]"):
        plotting.plot_weight_trajectories({"m": [ragged]}, tmp_path / "x.png")
    with pytest.raises(ValueError, match=r"losses\['m'\]\[0\] has shape \[3\]; expected \[steps"):
        plotting.plot_loss_curves({"m": [torch.ones(3)]}, tmp_path / "x.png")
    with pytest.raises(ValueError, match=r"cos_min\['m'\] has shape \[2, 2\]"):
        plotting.plot_cosine_distributions({"m": torch.ones(2, 2)}, tmp_path / "x.png")
    with pytest.raises(
        ValueError, match=r"series\['a'\]\['mean'\] has shape \[2\]; expected \[3\]"
    ):
        plotting.plot_metric_panels({"a": [1.0, 2.0]}, tmp_path / "x.png", "t", [0, 1, 2], "epoch")


def test_loss_panels_go_log_only_over_two_orders_of_magnitude(tmp_path: Path, figures) -> None:
    wide = torch.tensor([[1000.0, 5.0], [10.0, 1.0], [0.5, 0.0]])
    narrow = torch.tensor([[2.0, 1.0], [1.5, 0.5]])
    plotting.plot_loss_curves({"wide": [wide], "narrow": [narrow]}, tmp_path / "l.png")
    wide_axes, narrow_axes = figures[0].axes[:2]
    assert (wide_axes.get_yscale(), wide_axes.get_ylabel()) == ("log", "loss (log scale)")
    assert (narrow_axes.get_yscale(), narrow_axes.get_ylabel()) == ("linear", "loss")


def test_solve_steps_are_filled_and_one_objective_is_said(tmp_path: Path, figures) -> None:
    weights = {"marble": [torch.rand(4, 2)], "weighted_sum": [torch.ones(4, 1)]}
    solved = {"marble": [[1, 0, 1, 0]]}
    path = plotting.plot_weight_trajectories(weights, tmp_path / "w.png", solved=solved)
    assert_png(path)
    marble, scalar = figures[0].axes[:2]
    hollow = [line for line in marble.get_lines() if line.get_markerfacecolor() == "none"]
    assert sorted(len(line.get_xdata()) for line in hollow) == [0, 2, 2]  # and the legend's
    assert [text.get_text() for text in scalar.texts] == [plotting.ONE_OBJECTIVE]
