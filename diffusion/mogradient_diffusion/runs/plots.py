"""Figures of training runs, read back from their ``metrics.jsonl``: one run into
``<run>/plots/``, several compared in one folder (a line, panel or violin per run)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from mogradient.plotting import (
    plot_cosine_distributions,
    plot_metric_overlay,
    plot_metric_panels,
    plot_weight_trajectories,
)
from mogradient_diffusion.config.yaml_text import read_yaml
from mogradient_diffusion.runs import metric_keys as keys
from mogradient_diffusion.runs.metrics_log import read_metrics

PLOTS = "plots"
PROBE_HINT = "set run.conflict_probe=true to measure every step"

Records = list[dict[str, Any]]


def plot_run(run_dir: str | Path) -> list[Path]:
    """Per-reward mean curves, weight trajectories and worst-cosine distribution (PNG) of
    one run into ``<run>/plots/``, each written when the run logged what it shows.

    ValueError when ``metrics.jsonl`` holds nothing to plot or a line that is no record.
    """
    return plot_runs([run_dir])


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path | None = None) -> list[Path]:
    """The figures of ``plot_run`` drawn once for all ``run_dirs``, into ``out`` (required
    for several runs; one run defaults to its ``plots/``), each run labelled by its folder
    name, or by its strategy where folder names collide.

    ValueError (one line) for several runs without ``out``, or a run with nothing to plot.
    """
    directories = [Path(run_dir) for run_dir in run_dirs]
    if len(directories) > 1 and out is None:
        raise ValueError(f"{len(directories)} runs: give a folder for their figures (--out DIR)")
    out = Path(out) if out is not None else directories[0] / PLOTS
    runs = dict(zip(_labels(directories), map(_records, directories), strict=True))
    figures = (
        _plot_rewards(runs, out / "rewards.png"),
        _plot_weights(runs, out / "weights.png"),
        _plot_cosines(runs, out / "cosines.png"),
    )
    paths = [path for path in figures if path is not None]
    if not paths:
        where = " and ".join(f"{d}/metrics.jsonl" for d in directories)
        raise ValueError(f"{where} logs no rewards or weights: nothing to plot")
    return paths


def _labels(directories: list[Path]) -> list[str]:
    """Folder names; a name shared by several runs gives way to the run's strategy, and
    the path as given is the last resort."""
    names = [directory.resolve().name for directory in directories]
    labels = [
        _strategy(directory) or name if names.count(name) > 1 else name
        for directory, name in zip(directories, names, strict=True)
    ]
    if len(set(labels)) == len(labels):
        return labels
    paths = [str(directory) for directory in directories]
    if len(set(paths)) < len(paths):
        raise ValueError(f"a run is given twice: {' '.join(paths)}")
    return paths


def _strategy(directory: Path) -> str | None:
    """The strategy the run's ``config.yaml`` names, None when it cannot be read."""
    try:
        config = read_yaml(directory / "config.yaml")
    except (OSError, ValueError):
        return None
    strategy = config.get("strategy") if isinstance(config, dict) else None
    name = strategy.get("name") if isinstance(strategy, dict) else None
    return name if isinstance(name, str) else None


def _records(run_dir: Path) -> Records:
    """The run's records, each checked to be a JSON object (a damaged file says where)."""
    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{run_dir}/metrics.jsonl is empty: nothing to plot yet")
    for number, record in enumerate(records, 1):
        if not isinstance(record, dict):
            raise ValueError(
                f"{run_dir}/metrics.jsonl: record {number} ({json.dumps(record)[:40]}) is "
                "not a JSON object; the file is damaged"
            )
    return records


def _reward_names(records: Records) -> list[str]:
    """Every reward logged as ``reward/<name>/mean`` in any epoch, in order of appearance."""
    names = (keys.reward_of_mean(key) for record in records for key in record)
    return list(dict.fromkeys(name for name in names if name is not None))


def _plot_rewards(runs: dict[str, Records], path: Path) -> Path | None:
    """Each reward's mean (and ±1 std band, within the reward's range) per epoch, in its
    own panel (rewards live on different scales), one line per run that has it."""
    rewards = {label: _reward_names(records) for label, records in runs.items()}
    names = list(dict.fromkeys(name for names in rewards.values() for name in names))
    if not names:
        return None
    limits = {name: limit for name in names if (limit := value_range(name)) is not None}
    title = "Mean reward per epoch (band: ±1 std over the epoch's images)"
    if len(runs) == 1:
        (records,) = runs.values()
        means, stds = _reward_series(records, names)
        return plot_metric_panels(
            means, path, title, _epochs(records), "epoch", "mean reward", stds, limits
        )
    means: dict[str, dict[str, list[float]]] = {name: {} for name in names}
    stds: dict[str, dict[str, list[float]]] = {name: {} for name in names}
    for label, records in runs.items():
        run_means, run_stds = _reward_series(records, rewards[label])
        for name in rewards[label]:
            means[name][label], stds[name][label] = run_means[name], run_stds[name]
    epochs = {label: _epochs(records) for label, records in runs.items()}
    return plot_metric_overlay(means, path, title, epochs, "epoch", "mean reward", stds, limits)


def _reward_series(
    records: Records, names: list[str]
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each reward's mean and std per epoch (NaN where an epoch lacks it)."""
    means = {name: [_number(r.get(keys.reward_mean(name))) for r in records] for name in names}
    stds = {name: [_number(r.get(keys.reward_std(name))) for r in records] for name in names}
    return means, stds


def _epochs(records: Records) -> list[float]:
    return [_number(record.get(keys.STEP, index)) for index, record in enumerate(records)]


def value_range(reward: str) -> tuple[float, float] | None:
    """The range reward ``reward`` (a name or an alias) declares on its class; None for
    a reward this process does not know (a user's) or whose range depends on its options."""
    from mogradient_diffusion.rewards import REWARDS

    try:
        declared = getattr(REWARDS[reward], "value_range", None)
    except (KeyError, ImportError):
        return None
    if not isinstance(declared, tuple) or len(declared) != 2:
        return None
    return float(declared[0]), float(declared[1])


def _plot_weights(runs: dict[str, Records], path: Path) -> Path | None:
    """Each run's weight shares per optimizer step in its own panel, solve steps filled
    and cached steps hollow; a run with one objective says so instead of a flat line."""
    weights, solved, names = {}, {}, {}
    for label, records in runs.items():
        steps = [step for step in _all_steps(records) if _is_vector(step.get(keys.WEIGHTS))]
        if steps and len({len(step[keys.WEIGHTS]) for step in steps}) == 1:
            weights[label] = [torch.tensor([step[keys.WEIGHTS] for step in steps])]
            names[label] = _objective_names(records, len(steps[0][keys.WEIGHTS]))
            if any(keys.SOLVED in step for step in steps):
                solved[label] = [[bool(step.get(keys.SOLVED)) for step in steps]]
    if not weights:
        return None
    return plot_weight_trajectories(
        weights,
        path,
        title="Weight shares per optimizer step (filled: solve step, hollow: cached)",
        objective_names=names,
        solved=solved,
    )


def _objective_names(records: Records, count: int) -> list[str]:
    """The run's objective names when they match its weights, else numbered ones."""
    names = records[-1].get(keys.OBJECTIVES)
    if isinstance(names, list) and len(names) == count:
        return [str(name) for name in names]
    return [f"objective {k + 1}" for k in range(count)]


def _plot_cosines(runs: dict[str, Records], path: Path) -> Path | None:
    """The worst cosine's distribution per run, saying how many steps were measured: cached
    and scalar steps log none without the conflict probe."""
    cosines, counts = {}, {}
    for label, records in runs.items():
        steps = [step for step in _all_steps(records) if not step.get(keys.SKIPPED)]
        values = [_number(step.get(keys.COS_MIN)) for step in steps]
        cosines[label] = [value for value in values if math.isfinite(value)]
        counts[label] = (sum(keys.COS_MIN in step for step in steps), len(steps))
    if not any(cosines.values()):
        return None
    title = "Worst cosine between the step and an objective's gradient"
    missing = {label: count for label, count in counts.items() if count[0] < count[1]}
    if missing:
        title += "\n" + _measured_caption(missing, several=len(runs) > 1)
    return plot_cosine_distributions(cosines, path, title=title)


def _measured_caption(missing: dict[str, tuple[int, int]], several: bool) -> str:
    """``n of m steps measured`` per run that lacks some, and how to measure them all."""
    parts = [
        f"{label + ': ' if several else ''}{measured} of {total} steps measured"
        for label, (measured, total) in missing.items()
    ]
    return f"{'; '.join(parts)}; {PROBE_HINT}"


def _all_steps(records: Records) -> list[dict[str, Any]]:
    return [step for record in records for step in _steps(record)]


def _steps(record: dict[str, Any]) -> list[dict[str, Any]]:
    steps = record.get(keys.OPTIMIZER_STEPS)
    return [step for step in steps if isinstance(step, dict)] if isinstance(steps, list) else []


def _is_vector(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_number(v) for v in value)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _number(value: object) -> float:
    return float(value) if _is_number(value) else math.nan
