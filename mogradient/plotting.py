"""PNG plots of harmonizer behaviour: conflict, weights, losses and metrics.

matplotlib is optional (``pip install 'mogradient[plot]'``) and imported only when a
function runs. Figures are drawn on an explicit Agg canvas, so plotting never changes
the caller's pyplot backend or global state. Every function writes one PNG and returns
its path.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

_PANEL_COLUMNS = 4
_PANEL_SIZE = (3.6, 3.0)
_TITLE_INCHES = 0.85
_LEGEND_INCHES = 0.35
_MARKED_POINTS = 60  # lines with at most this many points get markers


def plot_cosine_distributions(
    cos_min: Mapping[str, Sequence[float] | torch.Tensor],
    path: str | Path,
    title: str = "Worst cosine between the step and an objective's gradient",
) -> Path:
    """Violins of the per-step worst cosine, one per method; below zero some objective got worse.

    Each tick label carries the fraction of steps with a negative worst cosine. NaN
    entries (Pareto-stationary steps, where cosines are undefined) are left out.
    """
    width = max(6.0, 0.9 * len(cos_min) + 2)
    figure = _new_figure(width, 4.4)
    figure.subplots_adjust(left=0.75 / width, right=1 - 0.2 / width, top=0.9, bottom=0.22)
    axes = figure.add_subplot()
    labels = []
    for position, (method, values) in enumerate(cos_min.items(), start=1):
        finite = _finite(values)
        labels.append(f"{method}\n{_negative_share(finite)}")
        _draw_distribution(axes, finite, position)
    axes.axhline(0.0, color="firebrick", linewidth=1, linestyle="--", label="no conflict above")
    axes.set_xticks(range(1, len(labels) + 1), labels, fontsize=8)
    axes.set_ylim(-1.05, 1.05)
    axes.set_ylabel("cos_min per step")
    axes.set_xlabel("method (share of steps with cos_min < 0)")
    axes.set_title(title)
    axes.legend(loc="lower left", fontsize=8)
    return _save(figure, path)


def plot_weight_trajectories(
    weights: Mapping[str, Sequence[torch.Tensor]],
    path: str | Path,
    title: str = "Weight shares over steps",
    objective_names: Sequence[str] | None = None,
) -> Path:
    """Each method's weight shares w_k / sum_j |w_j| per step, one line per objective and run.

    Shares rather than raw weights: Adam ignores the overall scale of the step, so the
    split between objectives is what distinguishes the methods.
    """
    figure, panels = _panel_grid(len(weights))
    for axes, (method, runs) in zip(panels, weights.items(), strict=False):
        for run in runs:
            run = torch.as_tensor(run, dtype=torch.float64)
            shares = run / run.abs().sum(dim=1, keepdim=True).clamp_min(1e-300)
            _draw_objective_lines(axes, shares, objective_names)
        axes.set_title(method)
        axes.set_xlabel("step")
        axes.set_ylabel("w_k / sum |w|")
        _integer_ticks(axes)
    _finish_panels(figure, panels, len(weights), title)
    return _save(figure, path)


def plot_loss_curves(
    losses: Mapping[str, Sequence[torch.Tensor]],
    path: str | Path,
    title: str = "Per-objective losses over steps",
    objective_names: Sequence[str] | None = None,
) -> Path:
    """Each method's per-objective losses per step, one line per objective and run."""
    figure, panels = _panel_grid(len(losses))
    for axes, (method, runs) in zip(panels, losses.items(), strict=False):
        for run in runs:
            _draw_objective_lines(axes, torch.as_tensor(run, dtype=torch.float64), objective_names)
        axes.set_title(method)
        axes.set_xlabel("step")
        axes.set_ylabel("loss")
        _integer_ticks(axes)
    _finish_panels(figure, panels, len(losses), title)
    return _save(figure, path)


def plot_metric_panels(
    series: Mapping[str, Sequence[float] | torch.Tensor],
    path: str | Path,
    title: str,
    x: Sequence[float] | torch.Tensor,
    xlabel: str,
    ylabel: str = "",
    spread: Mapping[str, Sequence[float] | torch.Tensor] | None = None,
) -> Path:
    """One panel per series with its own y axis (rewards on scales 1 and 100 side by side).

    Points are marked, so a single finite value still shows; ``spread`` (e.g. the std
    over images) is drawn as a band of ±1 around the line; NaN values are gaps.
    """
    figure, panels = _panel_grid(len(series))
    x = torch.as_tensor(x, dtype=torch.float64)
    known = x[torch.isfinite(x)]
    for axes, (name, values) in zip(panels, series.items(), strict=False):
        values = torch.as_tensor(values, dtype=torch.float64)
        axes.plot(x, values, marker="o", markersize=4, linewidth=1.2, label="mean")
        if spread is not None and name in spread:
            band = torch.as_tensor(spread[name], dtype=torch.float64)
            axes.fill_between(x, values - band, values + band, alpha=0.2, label="±1 std")
        if not torch.isfinite(values).any():
            axes.text(
                0.5, 0.5, "no finite value", ha="center", va="center", transform=axes.transAxes
            )
        axes.set_title(name)
        axes.set_xlabel(xlabel)
        axes.set_ylabel(ylabel)
        if len(known):  # every panel spans the whole run, even one with a lone point
            axes.set_xlim(float(known.min()) - 0.5, float(known.max()) + 0.5)
        _integer_ticks(axes)
    _finish_panels(figure, panels, len(series), title)
    return _save(figure, path)


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise ImportError("plotting needs matplotlib: pip install 'mogradient[plot]'") from error


def _new_figure(width: float, height: float) -> Any:
    """A figure on an Agg canvas (no pyplot): margins are set by hand, since a layout engine
    re-solves the whole layout at save time and doubles the cost of a many-panel figure."""
    _require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height))
    FigureCanvasAgg(figure)
    return figure


def _panel_grid(count: int) -> tuple[Any, list[Any]]:
    """A figure with one panel per method, ``_PANEL_COLUMNS`` to a row, room for a legend."""
    if count == 0:
        raise ValueError("nothing to plot: no methods given")
    columns = min(count, _PANEL_COLUMNS)
    rows = math.ceil(count / columns)
    width = _PANEL_SIZE[0] * max(columns, 2) + 0.8  # room for a one-row legend
    height = _PANEL_SIZE[1] * rows + _TITLE_INCHES + _LEGEND_INCHES
    figure = _new_figure(width, height)
    figure.subplots_adjust(
        left=0.65 / width,
        right=1 - 0.15 / width,
        top=1 - _TITLE_INCHES / height,
        bottom=(_LEGEND_INCHES + 0.45) / height,
        wspace=0.38,
        hspace=0.6,
    )
    grid = figure.subplots(rows, columns, squeeze=False)
    return figure, list(grid.flat)


def _finish_panels(figure: Any, panels: list[Any], used: int, title: str) -> None:
    """Hide spare panels, add one legend for the whole figure and the title."""
    for spare in panels[used:]:
        spare.set_visible(False)
    handles, labels = panels[0].get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    if unique:
        figure.legend(
            unique.values(),
            unique.keys(),
            loc="lower center",
            ncols=min(len(unique), 6),
            fontsize=8,
        )
    figure.suptitle(title)


def _draw_distribution(axes: Any, values: torch.Tensor, position: int) -> None:
    """A violin, or a single tick when the values have no spread (the KDE would be singular)."""
    if len(values) == 0:
        axes.text(position, 0, "no finite\ncosine", ha="center", va="center", fontsize=7)
    elif float(values.max() - values.min()) < 1e-9:
        axes.plot([position - 0.3, position + 0.3], [float(values[0])] * 2, color="tab:blue")
    else:
        axes.violinplot(values.numpy(), positions=[position], showmedians=True, widths=0.8)


def _draw_objective_lines(
    axes: Any, values: torch.Tensor, objective_names: Sequence[str] | None
) -> None:
    """One line per objective; points marked on short runs, where a lone value (or one
    between gaps) would otherwise not be drawn at all."""
    steps = torch.arange(len(values))
    marker = "o" if len(values) <= _MARKED_POINTS else None
    for objective in range(values.shape[1]):
        name = objective_names[objective] if objective_names else f"objective {objective + 1}"
        axes.plot(
            steps,
            values[:, objective],
            color=f"C{objective}",
            linewidth=1,
            alpha=0.7,
            label=name,
            marker=marker,
            markersize=3,
        )


def _integer_ticks(axes: Any) -> None:
    """Steps and epochs are counts: no tick at 0.25."""
    from matplotlib.ticker import MaxNLocator

    axes.xaxis.set_major_locator(MaxNLocator(integer=True))


def _finite(values: Sequence[float] | torch.Tensor) -> torch.Tensor:
    values = torch.as_tensor(values, dtype=torch.float64).reshape(-1)
    return values[torch.isfinite(values)]


def _negative_share(values: torch.Tensor) -> str:
    if len(values) == 0:
        return "(n/a)"
    return f"({100 * float((values < 0).double().mean()):.0f}%)"


def _save(figure: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    return path
