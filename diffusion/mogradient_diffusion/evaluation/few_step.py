"""Reward against the number of sampling steps: SDPO's claim that reward holds at few steps.

SDPO trains on dense step-level rewards so that a model stays good when sampled with far
fewer steps than it was trained with. This runs the ordinary evaluation (same prompts,
seeds and metrics; only ``steps`` changes) at each step count, one folder per count, and
tabulates every metric's mean and 95% interval by step count in ``few_steps.json`` and
``few_steps.md``: run it for the base model and for each trained LoRA and compare rows.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mogradient_diffusion.evaluation.evaluate import (
    EvalSettings,
    evaluate,
    interval_text,
    number_text,
)

FEW_STEPS = (1, 2, 4, 8, 16)


def evaluate_at_steps(settings: EvalSettings, steps: Sequence[int] = FEW_STEPS) -> Path:
    """``evaluate`` at each of ``steps`` into ``<out>/steps_<n>``; returns ``<out>``."""
    if not steps or any(not isinstance(n, int) or n < 1 for n in steps):
        raise ValueError(f"steps must be positive integers, got {list(steps)}")
    out = Path(settings.out).expanduser()
    label = settings.label or out.name
    table: dict[str, Any] = {"label": label, "metrics": list(settings.metrics), "steps": {}}
    for count in sorted(set(steps)):
        folder = evaluate(
            dataclasses.replace(
                settings, steps=count, out=str(out / f"steps_{count:02d}"), label=label
            )
        )
        summary = json.loads((folder / "summary.json").read_text())
        table["steps"][str(count)] = {
            name: {key: entry[key] for key in ("mean", "ci95", "n")}
            for name, entry in summary["metrics"].items()
        }
    (out / "few_steps.json").write_text(json.dumps(table, indent=2))
    (out / "few_steps.md").write_text(few_steps_markdown(table))
    return out


def few_steps_markdown(table: dict[str, Any]) -> str:
    """One row per step count, one column per metric: mean [95% interval] (n/a where a
    metric had no value, or one value and so no interval)."""
    metrics = table["metrics"]
    lines = [
        f"# Reward by sampling steps: {table['label']}",
        "",
        "| steps | " + " | ".join(metrics) + " |",
        "|---:|" + "---:|" * len(metrics),
    ]
    for count, values in table["steps"].items():
        cells = [f"{number_text(values[m]['mean'])} {interval_text(values[m])}" for m in metrics]
        lines.append(f"| {count} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


__all__ = ["FEW_STEPS", "evaluate_at_steps", "few_steps_markdown"]
