"""Figures of one training run, read back from its ``metrics.jsonl``, into ``<run>/plots/``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from mogradient.plotting import (
    plot_cosine_distributions,
    plot_metric_panels,
    plot_weight_trajectories,
)
from mogradient_diffusion.runs import metric_keys as keys
from mogradient_diffusion.runs.metrics_log import read_metrics

PLOTS = "plots"


def plot_run(run_dir: str | Path) -> list[Path]:
    """Per-reward mean curves, weight trajectories and worst-cosine distribution (PNG),
    each written when the run logged what it shows.

    ValueError when ``metrics.jsonl`` holds nothing to plot or a line that is no record.
    """
    run_dir = Path(run_dir)
    records = _records(run_dir)
    out = run_dir / PLOTS
    rewards = _reward_names(records)
    paths = [_plot_rewards(records, rewards, out / "rewards.png")] if rewards else []
    steps = [step for record in records for step in _steps(record)]
    weights = [step[keys.WEIGHTS] for step in steps if _is_vector(step.get(keys.WEIGHTS))]
    if weights and len({len(w) for w in weights}) == 1:
        names = records[-1].get("objectives") or None
        paths.append(
            plot_weight_trajectories(
                {run_dir.name: [torch.tensor(weights)]},
                out / "weights.png",
                title="Weight shares per optimizer step",
                objective_names=names,
            )
        )
    cosines = [_number(step.get(keys.COS_MIN)) for step in steps]
    cosines = [value for value in cosines if math.isfinite(value)]
    if cosines:
        paths.append(plot_cosine_distributions({run_dir.name: cosines}, out / "cosines.png"))
    if not paths:
        raise ValueError(f"{run_dir}/metrics.jsonl logs no rewards or weights: nothing to plot")
    return paths


def _records(run_dir: Path) -> list[dict[str, Any]]:
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


def _reward_names(records: list[dict[str, Any]]) -> list[str]:
    """Every reward logged as ``reward/<name>/mean`` in any epoch, in order of appearance."""
    names = (keys.reward_of_mean(key) for record in records for key in record)
    return list(dict.fromkeys(name for name in names if name is not None))


def _plot_rewards(records: list[dict[str, Any]], names: list[str], path: Path) -> Path:
    """Each reward's mean (and ±1 std band) per epoch, in its own panel: rewards live on
    different scales."""
    epochs = [_number(record.get(keys.STEP, index)) for index, record in enumerate(records)]
    return plot_metric_panels(
        {name: [_number(r.get(keys.reward_mean(name))) for r in records] for name in names},
        path,
        title="Mean reward per epoch (band: ±1 std over the epoch's images)",
        x=epochs,
        xlabel="epoch",
        ylabel="mean reward",
        spread={name: [_number(r.get(keys.reward_std(name))) for r in records] for name in names},
    )


def _steps(record: dict[str, Any]) -> list[dict[str, Any]]:
    steps = record.get(keys.OPTIMIZER_STEPS)
    return [step for step in steps if isinstance(step, dict)] if isinstance(steps, list) else []


def _is_vector(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_number(v) for v in value)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _number(value: object) -> float:
    return float(value) if _is_number(value) else math.nan
