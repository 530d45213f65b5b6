"""Figures of one training run, read back from its ``metrics.jsonl``."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from mogradient.plotting import (
    plot_cosine_distributions,
    plot_loss_curves,
    plot_weight_trajectories,
)
from mogradient_diffusion.runlog import read_metrics


def plot_run(run_dir: str | Path) -> list[Path]:
    """Per-reward mean curves, weight trajectories and worst-cosine distribution (PNG)."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{run_dir}/metrics.jsonl is empty: nothing to plot yet")
    out = run_dir / "plots"
    name = run_dir.name
    reward_keys = sorted(
        key for key in records[0] if key.startswith("reward/") and key.endswith("/mean")
    )
    rewards = torch.tensor(
        [[_number(record.get(key)) for key in reward_keys] for record in records],
        dtype=torch.float64,
    )
    reward_names = [key.split("/")[1] for key in reward_keys]
    paths = [
        plot_loss_curves(
            {name: [rewards]},
            out / "rewards.png",
            title="Mean reward per epoch",
            objective_names=reward_names,
        )
    ]
    steps = [step for record in records for step in record.get("optimizer_steps", [])]
    weights = [step["weights"] for step in steps if step.get("weights")]
    if weights and len({len(w) for w in weights}) == 1:
        names = records[-1].get("objectives") or None
        paths.append(
            plot_weight_trajectories(
                {name: [torch.tensor(weights)]}, out / "weights.png", objective_names=names
            )
        )
    cosines = [_number(step.get("harmonize/cos_min")) for step in steps]
    cosines = [value for value in cosines if math.isfinite(value)]
    if cosines:
        paths.append(plot_cosine_distributions({name: cosines}, out / "cosines.png"))
    return paths


def _number(value: object) -> float:
    return float(value) if isinstance(value, int | float) else math.nan
