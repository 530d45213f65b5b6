"""The toy problems' pictures: runs in objective space and in parameter space."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.toys.problems import ToyProblem, Trajectory
from mogradient.plotting import _finish_panels, _panel_grid, _save


def plot_objective_space(
    problem: ToyProblem,
    trajectories: Mapping[str, Sequence[Trajectory]],
    path: str | Path,
    title: str | None = None,
) -> Path:
    """Runs of a two-objective problem in the (L1, L2) plane, with the true Pareto front."""
    if problem.num_objectives != 2:
        raise ValueError(
            f"objective-space plots need 2 objectives, {problem.name} has {problem.num_objectives}"
        )
    front = problem.losses(problem.front) if problem.front is not None else None
    figure, panels = _panel_grid(len(trajectories))
    for axes, (method, runs) in zip(panels, trajectories.items(), strict=False):
        if front is not None:
            _draw_front(axes, front)
        for index, run in enumerate(runs):
            _draw_path(axes, run.losses, _start_color(index), run.positions[0])
        axes.set_title(method)
        axes.set_xlabel("L1")
        axes.set_ylabel("L2")
    _finish_panels(figure, panels, len(trajectories), title or f"{problem.name}: objective space")
    return _save(figure, path)


def plot_parameter_space(
    problem: ToyProblem,
    trajectories: Mapping[str, Sequence[Trajectory]],
    path: str | Path,
    title: str | None = None,
    contour: bool = True,
) -> Path:
    """Runs of a 2-D problem in parameter space over contours of the mean loss, with the front."""
    if problem.dimension != 2:
        raise ValueError(
            f"parameter-space plots need 2 parameters, {problem.name} has {problem.dimension}"
        )
    bounds = _bounds(problem, trajectories)
    field = _mean_loss_field(problem, bounds) if contour else None
    figure, panels = _panel_grid(len(trajectories))
    for axes, (method, runs) in zip(panels, trajectories.items(), strict=False):
        if field is not None:
            axes.contourf(*field, levels=20, cmap="Greys", alpha=0.45, zorder=1)
        if problem.front is not None:
            _draw_front(axes, problem.front)
        for index, run in enumerate(runs):
            _draw_path(axes, run.positions, _start_color(index), run.positions[0])
        axes.set_xlim(bounds[0], bounds[1])
        axes.set_ylim(bounds[2], bounds[3])
        axes.set_title(method)
        axes.set_xlabel("x1")
        axes.set_ylabel("x2")
    _finish_panels(figure, panels, len(trajectories), title or f"{problem.name}: parameter space")
    return _save(figure, path)


def _draw_front(axes: Any, front: torch.Tensor) -> None:
    axes.scatter(
        front[:, 0], front[:, 1], s=1, color="tab:olive", alpha=0.4, label="Pareto set", zorder=2
    )


def _draw_path(axes: Any, points: torch.Tensor, color: str, start: torch.Tensor) -> None:
    label = f"start ({float(start[0]):g}, {float(start[1]):g})" if len(start) == 2 else None
    axes.plot(points[:, 0], points[:, 1], color=color, linewidth=1.5, label=label, zorder=3)
    axes.scatter(points[:1, 0], points[:1, 1], color=color, marker="o", s=20, zorder=4)
    axes.scatter(
        points[-1:, 0],
        points[-1:, 1],
        color=color,
        marker="*",
        s=60,
        edgecolors="black",
        linewidths=0.5,
        zorder=4,
    )


def _mean_loss_field(
    problem: ToyProblem, bounds: tuple[float, float, float, float]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Grid axes and the mean loss on the grid, for contours."""
    first = torch.linspace(bounds[0], bounds[1], 120, dtype=torch.float64)
    second = torch.linspace(bounds[2], bounds[3], 120, dtype=torch.float64)
    grid = torch.stack(torch.meshgrid(first, second, indexing="xy"), dim=-1)
    return first, second, problem.losses(grid).mean(dim=-1)


def _bounds(
    problem: ToyProblem, trajectories: Mapping[str, Sequence[Trajectory]]
) -> tuple[float, float, float, float]:
    """A box around every run and the Pareto set, with a margin."""
    clouds = [run.positions.detach() for runs in trajectories.values() for run in runs]
    if problem.front is not None:
        clouds.append(problem.front)
    points = torch.cat(clouds).to(torch.float64)
    low, high = points.min(dim=0).values, points.max(dim=0).values
    margin = 0.08 * (high - low).clamp_min(1.0)
    return (
        float(low[0] - margin[0]),
        float(high[0] + margin[0]),
        float(low[1] - margin[1]),
        float(high[1] + margin[1]),
    )


def _start_color(index: int) -> str:
    return f"C{(index + 2) % 10}"
