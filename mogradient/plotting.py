"""PNG plots of harmonizer behaviour: conflict, weights, losses and metrics.

matplotlib is optional (``pip install 'mogradient[plot]'``) and imported only when a
function runs. Figures are drawn on an explicit Agg canvas, so plotting never changes
the caller's pyplot backend or global state. Every function writes one PNG and returns
its path. Inputs of the wrong shape are refused with a one-line ``ValueError`` naming
the argument and the shape expected.
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
_LOG_SPAN = 100.0  # a loss panel whose positive values span more than this is drawn log
ONE_OBJECTIVE = "one objective: no per-reward weights"

Values = Sequence[float] | torch.Tensor
# One run's per-step vectors: a [steps, objectives] tensor, or one [objectives] per step.
Steps = torch.Tensor | Sequence[torch.Tensor] | Sequence[Sequence[float]]


def plot_cosine_distributions(
    cos_min: Mapping[str, Values],
    path: str | Path,
    title: str = "Worst cosine between the step and an objective's gradient",
) -> Path:
    """Violins of the per-step worst cosine, one per method; below zero some objective got worse.

    ``cos_min[method]``: one value per step, shape [steps]. Each tick label carries the
    fraction of steps with a negative worst cosine. NaN entries (Pareto-stationary steps,
    where cosines are undefined) are left out. ``title`` may hold a second line (a caption).
    """
    width = max(6.0, 0.9 * len(cos_min) + 2)
    height = 4.4
    figure = _new_figure(width, height)
    top = 1 - (0.2 + 0.25 * (title.count("\n") + 1)) / height
    figure.subplots_adjust(left=0.75 / width, right=1 - 0.2 / width, top=top, bottom=0.22)
    axes = figure.add_subplot()
    labels = []
    for position, (method, values) in enumerate(cos_min.items(), start=1):
        finite = _finite(_vector(values, f"cos_min[{method!r}]"))
        labels.append(f"{method}\n{_negative_share(finite)}")
        _draw_distribution(axes, finite, position)
    axes.axhline(0.0, color="firebrick", linewidth=1, linestyle="--", label="no conflict above")
    axes.set_xticks(range(1, len(labels) + 1), labels, fontsize=8)
    axes.set_ylim(-1.05, 1.05)
    axes.set_ylabel("cos_min per step")
    axes.set_xlabel("method (share of steps with cos_min < 0)")
    axes.set_title(title, fontsize=10 if "\n" in title else None)
    axes.legend(loc="lower left", fontsize=8)
    return _save(figure, path)


def plot_weight_trajectories(
    weights: Mapping[str, Sequence[Steps]],
    path: str | Path,
    title: str = "Weight shares over steps",
    objective_names: Sequence[str] | Mapping[str, Sequence[str]] | None = None,
    solved: Mapping[str, Sequence[Values]] | None = None,
) -> Path:
    """Each method's weight shares w_k / sum_j |w_j| per step, one line per objective and run.

    Shares rather than raw weights: Adam ignores the overall scale of the step, so the
    split between objectives is what distinguishes the methods. ``weights[method]``: runs,
    each [steps, objectives] (or a list of per-step [objectives] tensors, stacked).
    ``solved[method]``: per run, one flag per step ([steps]): solve steps are drawn
    filled, cached steps hollow. A run with one objective has no split to show: its panel
    says so. ``objective_names``: one list, or one per method.
    """
    figure, panels = _panel_grid(len(weights))
    colors = _objective_colors(objective_names)
    for axes, (method, runs) in zip(panels, weights.items(), strict=False):
        flags = solved.get(method) if solved is not None else None
        names = _names_of(objective_names, method)
        drawn = 0
        for index, run in enumerate(runs):
            run = _steps_by_objectives(run, f"weights[{method!r}][{index}]")
            if run.shape[1] < 2:
                continue
            shares = run / run.abs().sum(dim=1, keepdim=True).clamp_min(1e-300)
            marks = None if flags is None else _flags(flags, method, index, len(run))
            _draw_objective_lines(axes, shares, names, colors, marks)
            drawn += 1
        if drawn == 0:
            _note(axes, ONE_OBJECTIVE)
        elif flags is not None:
            _solve_legend(axes)
        axes.set_title(method)
        axes.set_xlabel("step")
        axes.set_ylabel("w_k / sum |w|")
        _integer_ticks(axes)
    _finish_panels(figure, panels, len(weights), title)
    return _save(figure, path)


def plot_loss_curves(
    losses: Mapping[str, Sequence[Steps]],
    path: str | Path,
    title: str = "Per-objective losses over steps",
    objective_names: Sequence[str] | None = None,
) -> Path:
    """Each method's per-objective losses per step, one line per objective and run.

    ``losses[method]``: runs, each [steps, objectives] (or a list of per-step
    [objectives] tensors, stacked). A panel whose positive losses span more than two
    orders of magnitude gets a log y axis, where the late, small losses stay readable.
    """
    figure, panels = _panel_grid(len(losses))
    for axes, (method, runs) in zip(panels, losses.items(), strict=False):
        tensors = [
            _steps_by_objectives(run, f"losses[{method!r}][{index}]")
            for index, run in enumerate(runs)
        ]
        for run in tensors:
            _draw_objective_lines(axes, run, objective_names)
        axes.set_title(method)
        axes.set_xlabel("step")
        axes.set_ylabel("loss (log scale)" if _log_scaled(axes, tensors) else "loss")
        _integer_ticks(axes)
    _finish_panels(figure, panels, len(losses), title)
    return _save(figure, path)


def plot_metric_panels(
    series: Mapping[str, Values],
    path: str | Path,
    title: str,
    x: Values,
    xlabel: str,
    ylabel: str = "",
    spread: Mapping[str, Values] | None = None,
    limits: Mapping[str, tuple[float, float]] | None = None,
) -> Path:
    """One panel per series with its own y axis (rewards on scales 1 and 100 side by side).

    ``x``: shape [points]; ``series[name]`` and ``spread[name]``: [points] each. Points
    are marked, so a single finite value still shows; ``spread`` (e.g. the std over
    images) is drawn as a band of ±1 around the line, clipped to ``limits[name]`` (a
    reward's range: a [0, 1] score's band does not dip below 0); NaN values are gaps.
    """
    return plot_metric_overlay(
        {name: {"mean": values} for name, values in series.items()},
        path,
        title,
        {"mean": x},
        xlabel,
        ylabel,
        None if spread is None else {name: {"mean": band} for name, band in spread.items()},
        limits,
        band_label="±1 std",
    )


def plot_metric_overlay(
    series: Mapping[str, Mapping[str, Values]],
    path: str | Path,
    title: str,
    x: Mapping[str, Values],
    xlabel: str,
    ylabel: str = "",
    spread: Mapping[str, Mapping[str, Values]] | None = None,
    limits: Mapping[str, tuple[float, float]] | None = None,
    band_label: str | None = None,
) -> Path:
    """One panel per series, one line (and band) per run in it: runs compared on one axis.

    ``x[run]``: shape [points of the run]; ``series[name][run]`` and
    ``spread[name][run]``: [points of the run] each. A panel lists only the runs that
    have its series; a run keeps its color in every panel. Bands are clipped to
    ``limits[name]``, as in ``plot_metric_panels``.
    """
    figure, panels = _panel_grid(len(series))
    xs = {run: _vector(values, f"x[{run!r}]") for run, values in x.items()}
    colors = {run: f"C{index}" for index, run in enumerate(xs)}
    spread = spread or {}
    for axes, (name, runs) in zip(panels, series.items(), strict=False):
        for run, values in runs.items():
            if run not in xs:
                raise ValueError(f"series[{name!r}][{run!r}] has no x: x[{run!r}] is missing")
            band = spread.get(name, {}).get(run)
            curve = _metric_curve(values, band, len(xs[run]), f"[{name!r}][{run!r}]")
            style = (colors[run], run, band_label)
            _draw_metric(axes, xs[run], curve, (limits or {}).get(name), style)
        _finish_metric_panel(axes, name, runs, xs, xlabel, ylabel)
    _finish_panels(figure, panels, len(series), title)
    return _save(figure, path)


def _metric_curve(
    values: Values, band: Values | None, count: int, where: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The line's values and its band, each checked to hold one value per x."""
    values = _vector(values, f"series{where}", count)
    return values, None if band is None else _vector(band, f"spread{where}", count)


def _draw_metric(
    axes: Any,
    x: torch.Tensor,
    curve: tuple[torch.Tensor, torch.Tensor | None],
    limit: tuple[float, float] | None,
    style: tuple[str, str, str | None],
) -> None:
    """The line, marked (a lone finite value still shows), and its band within ``limit``;
    ``style``: the color, the line's label and the band's (None: not in the legend)."""
    values, band = curve
    color, label, band_label = style
    axes.plot(x, values, marker="o", markersize=4, linewidth=1.2, color=color, label=label)
    if band is not None:
        low, high = limit if limit is not None else (-math.inf, math.inf)
        lower = (values - band).clamp(low, high)
        upper = (values + band).clamp(low, high)
        axes.fill_between(x, lower, upper, color=color, alpha=0.2, label=band_label)


def _finish_metric_panel(
    axes: Any,
    name: str,
    runs: Sequence[str],
    xs: Mapping[str, torch.Tensor],
    xlabel: str,
    ylabel: str,
) -> None:
    """Title, labels, a note when nothing is finite, and an x range spanning every run."""
    lines = (torch.as_tensor(line.get_ydata()) for line in axes.get_lines())
    if not any(torch.isfinite(values).any() for values in lines):
        _note(axes, "no finite value")
    axes.set_title(name)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    known = torch.cat([xs[run][torch.isfinite(xs[run])] for run in runs])
    if len(known):  # every panel spans the whole run, even one with a lone point
        axes.set_xlim(float(known.min()) - 0.5, float(known.max()) + 0.5)
    _integer_ticks(axes)


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
    """Hide spare panels, add one legend for the whole figure (every panel's entries,
    once each: runs compared may differ in objectives) and the title."""
    for spare in panels[used:]:
        spare.set_visible(False)
    unique: dict[str, Any] = {}
    for axes in panels[:used]:
        handles, labels = axes.get_legend_handles_labels()
        for label, handle in zip(labels, handles, strict=True):
            unique.setdefault(label, handle)
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
    axes: Any,
    values: torch.Tensor,
    objective_names: Sequence[str] | None,
    colors: Mapping[str, str] | None = None,
    solved: torch.Tensor | None = None,
) -> None:
    """One line per objective; points marked on short runs, where a lone value (or one
    between gaps) would otherwise not be drawn at all. With ``solved`` every point is
    marked: filled on solve steps, hollow on cached ones."""
    steps = torch.arange(len(values))
    marker = "o" if len(values) <= _MARKED_POINTS and solved is None else None
    for objective in range(values.shape[1]):
        name = objective_names[objective] if objective_names else f"objective {objective + 1}"
        color = (colors or {}).get(name, f"C{objective}")
        line = dict(color=color, linewidth=1, alpha=0.7, markersize=3)
        axes.plot(steps, values[:, objective], label=name, marker=marker, **line)
        if solved is not None:
            axes.plot(steps[solved], values[solved, objective], "o", **line)
            axes.plot(steps[~solved], values[~solved, objective], "o", mfc="none", **line)


def _solve_legend(axes: Any) -> None:
    """Legend entries for the filled and hollow markers (empty lines: no data)."""
    axes.plot([], [], "o", color="0.3", markersize=4, label="solve step")
    axes.plot([], [], "o", color="0.3", markersize=4, mfc="none", label="cached step")


def _objective_colors(
    objective_names: Sequence[str] | Mapping[str, Sequence[str]] | None,
) -> dict[str, str]:
    """One color per objective name across the figure, when methods name them apart."""
    if not isinstance(objective_names, Mapping):
        return {}
    names = dict.fromkeys(name for names in objective_names.values() for name in names)
    return {name: f"C{index}" for index, name in enumerate(names)}


def _names_of(
    objective_names: Sequence[str] | Mapping[str, Sequence[str]] | None, method: str
) -> Sequence[str] | None:
    if isinstance(objective_names, Mapping):
        return objective_names.get(method)
    return objective_names


def _note(axes: Any, text: str) -> None:
    """A line of text in the panel's middle, where a plot would mislead or be empty."""
    axes.text(0.5, 0.5, text, ha="center", va="center", fontsize=8, transform=axes.transAxes)


def _log_scaled(axes: Any, runs: Sequence[torch.Tensor]) -> bool:
    """Log y when the panel's positive finite values span more than ``_LOG_SPAN``."""
    values = torch.cat([run.reshape(-1) for run in runs]) if runs else torch.zeros(0)
    positive = values[torch.isfinite(values) & (values > 0)]
    if len(positive) == 0 or float(positive.max() / positive.min()) <= _LOG_SPAN:
        return False
    axes.set_yscale("log")
    return True


def _integer_ticks(axes: Any) -> None:
    """Steps and epochs are counts: no tick at 0.25."""
    from matplotlib.ticker import MaxNLocator

    axes.xaxis.set_major_locator(MaxNLocator(integer=True))


def _steps_by_objectives(run: Steps, argument: str) -> torch.Tensor:
    """``run`` as a [steps, objectives] float64 tensor; per-step vectors are stacked."""
    if not isinstance(run, torch.Tensor) and len(run) and not _is_scalar(run[0]):
        lengths = [len(step) for step in run]
        if len(set(lengths)) > 1:
            raise ValueError(
                f"{argument}: per-step vectors of different lengths {sorted(set(lengths))}; "
                "expected one value per objective at every step"
            )
        run = torch.stack([torch.as_tensor(step, dtype=torch.float64) for step in run])
    run = torch.as_tensor(run, dtype=torch.float64)
    if run.ndim != 2:
        raise ValueError(
            f"{argument} has shape {list(run.shape)}; expected [steps, objectives] "
            "(or a list of per-step [objectives] tensors)"
        )
    return run


def _vector(values: Values, argument: str, count: int | None = None) -> torch.Tensor:
    """``values`` as a [count] float64 tensor (any length when ``count`` is None)."""
    vector = torch.as_tensor(values, dtype=torch.float64)
    if vector.ndim != 1 or (count is not None and len(vector) != count):
        expected = "[points]" if count is None else f"[{count}] (one value per x)"
        raise ValueError(f"{argument} has shape {list(vector.shape)}; expected {expected}")
    return vector


def _flags(flags: Sequence[Values], method: str, index: int, steps: int) -> torch.Tensor:
    """Run ``index``'s solve flags as a [steps] bool tensor."""
    if index >= len(flags):
        raise ValueError(f"solved[{method!r}] has {len(flags)} runs; weights has more")
    return _vector(flags[index], f"solved[{method!r}][{index}]", steps).bool()


def _is_scalar(value: object) -> bool:
    return isinstance(value, int | float) or (isinstance(value, torch.Tensor) and value.ndim == 0)


def _finite(values: torch.Tensor) -> torch.Tensor:
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
