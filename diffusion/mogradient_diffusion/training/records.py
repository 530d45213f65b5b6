"""The records a run writes to metrics.jsonl, one per epoch with its optimizer steps, and
the progress bar's summary of them. Names come from ``metric_keys``."""

from __future__ import annotations

from typing import Any

import torch

from mogradient_diffusion.runs import metric_keys as keys


def epoch_record(
    reward_names: list[str],
    objectives: list[str],
    all_rewards: torch.Tensor,
    reward_seconds: dict[str, float],
    advantage_stats: dict[str, torch.Tensor],
    silent: list[bool],
    step_records: list[dict[str, Any]],
    times: dict[str, float],
    decay: float,
    failed: dict[str, int] | None = None,
) -> dict[str, Any]:
    """One epoch: timers, each reward's mean and spread over every rank's images, the
    samples a reward that degrades could not score (``failed``, per reward that counts
    them), the objectives' advantage statistics, the optimizer steps, and what gave no
    signal."""
    record: dict[str, Any] = dict(times)
    for index, name in enumerate(reward_names):
        column = all_rewards[:, index]
        # In float64: float32 rewards near its maximum (3.4e38) overflow a float32 sum.
        valid = column[~torch.isnan(column)].double()
        record[keys.reward_mean(name)] = float(valid.mean()) if len(valid) else float("nan")
        population_std = float(valid.std(unbiased=False)) if len(valid) else float("nan")
        record[keys.reward_std(name)] = population_std
        record[keys.reward_time(name)] = float(reward_seconds.get(name, float("nan")))
    for name, count in (failed or {}).items():
        record[keys.reward_failed(name)] = count
    for key, values in advantage_stats.items():
        for name, value in zip(objectives, values.tolist(), strict=True):
            record[keys.advantage_stat(name, key)] = value
    record[keys.OLD_DECAY] = decay
    record[keys.OPTIMIZER_STEPS] = step_records
    record[keys.OBJECTIVES] = objectives
    record[keys.OBJECTIVES_WITHOUT_SIGNAL] = [
        n for n, s in zip(objectives, silent, strict=True) if s
    ]
    record[keys.REWARDS_WITHOUT_SIGNAL] = [
        name for index, name in enumerate(reward_names) if torch.isnan(all_rewards[:, index]).all()
    ]
    return record


def skipped_step_record(reason: str, count: int) -> dict[str, Any]:
    """The record of an optimizer step that applied nothing (``count`` objectives)."""
    idle = dict.fromkeys(keys.STEP_TIMERS, 0.0)
    return idle | {keys.SKIPPED: reason, keys.SOLVED: 0, keys.WEIGHTS: [0.0] * count}


def progress_summary(record: dict[str, Any], reward_names: list[str]) -> dict[str, str]:
    """The progress bar's fields: each reward's mean, and with one objective per reward
    the weight its gradient got in the epoch's last step (on the raw gradients)."""
    summary = {name: f"{_number(record.get(keys.reward_mean(name))):.3g}" for name in reward_names}
    steps = record.get(keys.OPTIMIZER_STEPS) or [{}]
    weights = steps[-1].get(keys.WEIGHTS) or []
    if len(weights) == len(reward_names):
        for name, weight in zip(reward_names, weights, strict=True):
            summary[name] += f" (weight {weight:.2g})"
    return summary


def _number(value: Any) -> float:
    return float(value) if isinstance(value, int | float) else float("nan")
