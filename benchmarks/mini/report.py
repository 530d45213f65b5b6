"""Tables and plots of the miniature head-to-head, from the run and eval directories.

Everything here reads files the runs wrote (``metrics.jsonl``, ``summary.json``), so a
report can be rebuilt without retraining. Conflict statistics follow the paper: per
optimizer step, the worst reward's cosine with the applied update (negative: the step
hurts that reward to first order) and the variance of the cosines across rewards.
"""

from __future__ import annotations

import contextlib
import json
import math
import platform
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from benchmarks.mini.runs import RunResult
from miniature.recipe import HELD_OUT, TRAIN_REWARDS
from mogradient_diffusion.evaluation.compare import metric_value, ranked_table
from mogradient_diffusion.runs import metric_keys as keys
from mogradient_diffusion.runs.metrics_log import read_metrics

NFT_REFERENCE_ROWS = ("weighted_sum", "marble")  # repeated in the objectives table


def write_report(
    results: list[RunResult], out: Path, mode: str, seconds: float, workers: int
) -> dict[str, Any]:
    metrics = [*TRAIN_REWARDS, *HELD_OUT]
    scored = [r for r in results if not r.method.key.startswith("cost_")]
    rows = _method_rows(scored, metrics)
    main = [row for row in rows if row["table"] == "main"]
    ablations = [row for row in rows if row["table"] == "ablations" or row["key"] == "marble"]
    objectives = [
        row for row in rows if row["table"] == "objectives" or row["key"] in NFT_REFERENCE_ROWS
    ]
    conflict = _conflict_rows(scored)
    staleness = _staleness_rows(scored)
    versus_control = _control_rows(rows, list(TRAIN_REWARDS))
    cost = _cost_rows([r for r in results if r.method.key.startswith("cost_")])
    report = {
        "mode": mode,
        "seconds": round(seconds, 1),
        "workers": workers,
        "machine": _machine(),
        "metrics": {"trained": list(TRAIN_REWARDS), "held_out": list(HELD_OUT)},
        "rows": rows,
        "conflict": conflict,
        "staleness": staleness,
        "versus_control": versus_control,
        "cost": cost,
        "rising": _rising_rows(scored, list(TRAIN_REWARDS)),
    }
    (out / "results.json").write_text(json.dumps(report, indent=2))
    lines = [
        f"# MARBLE in miniature: {mode} run",
        "",
        _machine_line(report),
        "",
        "## Methods (held-out prompts)",
        "",
        *_table(main, metrics),
    ]
    if versus_control:
        lines += ["", *_control_table(versus_control, list(TRAIN_REWARDS))]
    if len(ablations) > 1:
        lines += ["", "## Ablations (MARBLE row repeated for reference)", ""]
        lines += _table(ablations, metrics)
    if len(objectives) > len(NFT_REFERENCE_ROWS):
        lines += ["", "## Objectives: DiffusionNFT (the rows above) vs Flow-GRPO vs SDPO", ""]
        lines += _table(objectives, metrics)
    if report["rising"]:
        lines += ["", *rising_table(report["rising"], list(TRAIN_REWARDS))]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    conflict_lines = _conflict_table(conflict)
    if staleness:
        conflict_lines += ["", *_staleness_table(staleness)]
    (out / "conflict.md").write_text("\n".join(conflict_lines) + "\n")
    if cost:
        (out / "cost.md").write_text("\n".join(_cost_table(cost)) + "\n")
    _plots(scored, out)
    _grids(scored, out)
    return report


def _method_rows(results: list[RunResult], metrics: list[str]) -> list[dict[str, Any]]:
    """Per method: mean and std over seeds of each metric's held-out value."""
    by_method: dict[str, list[RunResult]] = defaultdict(list)
    for result in results:
        by_method[result.method.key].append(result)
    rows = []
    for runs in by_method.values():
        values = {m: [] for m in metrics}
        for run in runs:
            summary = json.loads((run.eval_dir / "summary.json").read_text())
            for m in metrics:
                values[m].append(metric_value(m, summary["metrics"][m]))
        method = runs[0].method
        rows.append(
            {
                "key": method.key,
                "label": method.label,
                "table": method.table,
                "seeds": len(runs),
                "mean": {m: _mean(v) for m, v in values.items()},
                "std": {m: _std(v) for m, v in values.items()},
            }
        )
    return rows


def _mean(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return float(np.mean(finite)) if finite else math.nan


def _std(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return float(np.std(finite, ddof=1)) if len(finite) > 1 else math.nan


def _table(rows: list[dict[str, Any]], metrics: list[str]) -> list[str]:
    texts = [{m: _mean_std(row["mean"][m], row["std"][m]) for m in metrics} for row in rows]
    labels = [f"{row['label']} | {row['seeds']}" for row in rows]
    lines = ranked_table(labels, [row["mean"] for row in rows], metrics, texts, "method | seeds")
    note = (
        "Mean ± std over seeds of each metric on the held-out prompts; composite = mean of "
        "per-column z-scores across these rows. **best**, <u>second</u>. Trained rewards: "
        f"the first {len(TRAIN_REWARDS)} columns; the last {len(HELD_OUT)} no method "
        "trained on."
    )
    return [*lines, "", note]


def _mean_std(mean: float, std: float) -> str:
    return f"{mean:.3f}" + (f" ± {std:.3f}" if math.isfinite(std) else "")


# --- learning vs drift ----------------------------------------------------------------------


def _rising_rows(results: list[RunResult], rewards: list[str]) -> list[dict[str, Any]]:
    """Per main-table method, each reward it trains on: its mean on the training rollouts
    over the first and the last third of the epochs (mean over seeds)."""
    by_method: dict[str, list[RunResult]] = defaultdict(list)
    for result in results:
        if result.run_dir is not None and result.method.table == "main":
            by_method[result.method.key].append(result)
    rows = []
    for runs in by_method.values():
        per_reward: dict[str, dict[str, float]] = {}
        for name in _trained(runs[0].run_dir, rewards):
            firsts, lasts = [], []
            for run in runs:
                series = [_number(r.get(keys.reward_mean(name))) for r in read_metrics(run.run_dir)]
                series = [v for v in series if math.isfinite(v)]
                if len(series) >= 3:
                    third = len(series) // 3
                    firsts.append(float(np.mean(series[:third])))
                    lasts.append(float(np.mean(series[-third:])))
            if firsts:
                per_reward[name] = {"first": float(np.mean(firsts)), "last": float(np.mean(lasts))}
        if per_reward:
            method = runs[0].method
            rows.append({"key": method.key, "label": method.label, "rewards": per_reward})
    return rows


def _trained(run_dir: Path, rewards: list[str]) -> list[str]:
    """The rewards a run trains on: a single-reward run logs the others without training."""
    strategy = yaml.safe_load((run_dir / "config.yaml").read_text()).get("strategy", {})
    return [strategy["reward"]] if strategy.get("name") == "single" else rewards


def rising_table(rows: list[dict[str, Any]], rewards: list[str]) -> list[str]:
    lines = _per_reward_header(
        "## Trained rewards on the training rollouts: first third of the epochs -> last third",
        rewards,
    )
    for row in rows:
        cells = [
            f"{row['rewards'][n]['first']:.3f} -> {row['rewards'][n]['last']:.3f}"
            if n in row["rewards"]
            else ""
            for n in rewards
        ]
        lines.append(f"| {row['label']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "The rewards each method trains on, as it saw them on its own rollouts (training "
        "prompts): whether it climbs at all. Held-out means above say whether it carries over.",
    ]
    return lines


def _control_rows(rows: list[dict[str, Any]], rewards: list[str]) -> list[dict[str, Any]]:
    """Each trained method against the pure-noise control, per trained reward.

    ``separation`` is the difference in units of the pooled seed standard deviation
    sqrt((s_method^2 + s_control^2) / 2): what a training curve's drift cannot explain.
    """
    control = next((row for row in rows if row["key"] == "noise_control"), None)
    if control is None:
        return []
    compared = []
    for row in rows:
        if row["key"] in ("noise_control", "base"):
            continue
        per_reward = {}
        for reward in rewards:
            difference = row["mean"][reward] - control["mean"][reward]
            pooled = math.sqrt((row["std"][reward] ** 2 + control["std"][reward] ** 2) / 2)
            separation = difference / pooled if pooled > 0 else math.nan
            per_reward[reward] = {"difference": difference, "separation": separation}
        compared.append({"key": row["key"], "label": row["label"], "rewards": per_reward})
    return compared


def _per_reward_header(title: str, rewards: list[str]) -> list[str]:
    """A heading and the head of a table with one column per reward."""
    return [title, "", "| method | " + " | ".join(rewards) + " |", "|---|" + "---|" * len(rewards)]


def _control_table(rows: list[dict[str, Any]], rewards: list[str]) -> list[str]:
    lines = _per_reward_header(
        "## Learning or drift? Each method minus the pure-noise control", rewards
    )
    for row in rows:
        cells = []
        for reward in rewards:
            value = row["rewards"][reward]
            separation = value["separation"]
            cells.append(
                f"{value['difference']:+.3f}"
                + (f" ({separation:+.1f} sd)" if math.isfinite(separation) else "")
            )
        lines.append(f"| {row['label']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Held-out mean minus the control's (a run trained on a uniform-noise reward with the "
        "same recipe, prompts and seeds); in brackets, that difference in pooled seed "
        "standard deviations. Within about 2 sd, a column cannot be told from drift.",
    ]
    return lines


# --- conflict ------------------------------------------------------------------------------


def step_cosines(run_dir: Path) -> list[dict[str, Any]]:
    """(cos_min, cos_var, solved) of every optimizer step, in order, but stationary ones
    (no direction to compare with); the cosines are None where the step logged none (a
    cached step without the probe)."""
    steps = []
    for record in read_metrics(run_dir):
        for step in record[keys.OPTIMIZER_STEPS]:
            if step.get(keys.STATIONARY):
                continue
            low, var = step.get(keys.COS_MIN), step.get(keys.COS_VAR)
            usable = low is not None and var is not None
            steps.append(
                {
                    "cos_min": low if usable else None,
                    "cos_var": var if usable else None,
                    "solved": step[keys.SOLVED],
                }
            )
    return steps


# (row label, method key, which steps): MARBLE's steps split by solved vs cached; MARBLE
# every step solves (and so has cosines) on every step of every seed without the probe.
CONFLICT_ROWS = (
    ("weighted sum", "weighted_sum", None),
    ("MARBLE (N=10, rho 0.7), all steps", "marble", None),
    ("MARBLE: its full-solve steps", "marble", 1),
    ("MARBLE: its cached-weight steps", "marble", 0),
    ("MARBLE every step (N=1)", "marble_every_step", None),
    ("MARBLE as released, all steps", "marble_released", None),
    ("MARBLE as released: its solve steps (one micro-step fresh)", "marble_released", 1),
    ("GDPO", "gdpo", None),
    ("MARBLE smoothed weights on solve steps: its solve steps", "marble_smoothed", 1),
)


def _conflict_rows(results: list[RunResult]) -> list[dict[str, Any]]:
    rows = []
    for label, key, solved in CONFLICT_ROWS:
        runs = [r for r in results if r.method.key == key and r.run_dir is not None]
        per_run = []
        for run in runs:
            chosen = [
                s for s in step_cosines(run.run_dir) if solved is None or s[keys.SOLVED] == solved
            ]
            if chosen and all(s["cos_min"] is not None for s in chosen):  # a run counts whole
                per_run.append(chosen)
        steps = [s for run_steps in per_run for s in run_steps]
        if not steps:
            continue
        lows = np.array([s["cos_min"] for s in steps])
        rows.append(
            {
                "key": key,
                "label": label,
                "seeds": len(per_run),
                "steps": len(steps),
                "negative_fraction": float((lows < 0).mean()),
                "mean_min_cos": float(lows.mean()),
                "mean_cos_var": float(np.mean([s["cos_var"] for s in steps])),
            }
        )
    return rows


def _conflict_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "# Gradient conflict: worst-reward cosine with the applied update",
        "",
        "| method | seeds | steps | steps with min cos < 0 | mean min cos | mean cos variance |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['label']} | {row['seeds']} | {row['steps']} | "
            f"{row['negative_fraction']:.1%} | {row['mean_min_cos']:+.3f} | "
            f"{row['mean_cos_var']:.3f} |"
        )
    lines += [
        "",
        "Every optimizer step of seed 0 (`run.conflict_probe`), and the full-solve steps of "
        "every seed: K per-reward NFT gradients (per-reward advantages, the step's own "
        "samples and noise) against the update applied (on full-solve steps the gradients "
        "the solve used). MARBLE's "
        "solve steps apply the fresh MGDA solution, as in the published pseudocode, so "
        "their worst cosine is >= 0 up to round-off; the ablation that applies the "
        "EMA-smoothed weights on solve steps (`strategy.smooth_solve_steps`) has no such "
        "guarantee. Paper (SD3.5-M, 5 rewards): weighted sum 80% / -0.13 / 0.161, MARBLE "
        "0% / +0.37 / 0.006.",
    ]
    return lines


def _staleness_rows(results: list[RunResult]) -> list[dict[str, Any]]:
    """MARBLE's cached steps grouped by how many steps ago the weights were solved.

    Per step the probe compares the applied (cached-weight) update with the update a
    fresh MGDA solve on the same gradients would give: the price of amortization.
    """
    groups: dict[int, list[dict[str, float]]] = defaultdict(list)
    for result in results:
        if result.method.key != "marble" or result.run_dir is None:
            continue
        for record in read_metrics(result.run_dir):
            for step in record[keys.OPTIMIZER_STEPS]:
                if keys.COS_TO_FRESH in step:
                    groups[int(step[keys.STEPS_SINCE_SOLVE])].append(step)
    rows = []
    for since, steps in sorted(groups.items()):
        applied = np.array([_number(s.get(keys.COS_MIN)) for s in steps])
        to_fresh = np.array([s[keys.COS_TO_FRESH] for s in steps])
        rows.append(
            {
                "steps_since_solve": since,
                "steps": len(steps),
                "mean_cos_to_fresh": float(to_fresh.mean()),
                "min_cos_to_fresh": float(to_fresh.min()),
                "applied_negative_fraction": float(np.mean(applied[np.isfinite(applied)] < 0)),
                "fresh_mean_min_cos": float(np.mean([s[keys.FRESH_COS_MIN] for s in steps])),
            }
        )
    return rows


def _staleness_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "# How stale do MARBLE's cached weights get?",
        "",
        "| steps since the solve | steps | mean cos(applied, fresh) | lowest | "
        "applied steps with min cos < 0 | fresh solve's mean min cos |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['steps_since_solve']} | {row['steps']} | {row['mean_cos_to_fresh']:+.3f} | "
            f"{row['min_cos_to_fresh']:+.3f} | {row['applied_negative_fraction']:.0%} | "
            f"{row['fresh_mean_min_cos']:+.3f} |"
        )
    lines += [
        "",
        "MARBLE's cached-weight steps (main row, every seed): the update applied with the "
        "cached weights against the update a fresh MGDA solve on the same per-reward "
        "gradients would apply (cosine), whether the applied update conflicts with some "
        "reward, and the fresh solve's worst-reward cosine (>= 0 by construction).",
    ]
    return lines


# --- cost ----------------------------------------------------------------------------------


def _cost_rows(results: list[RunResult]) -> list[dict[str, Any]]:
    rows = []
    for result in results:
        records = read_metrics(result.run_dir)[1:]  # epoch 0: first-call costs
        steps = sum(len(r[keys.OPTIMIZER_STEPS]) for r in records)
        train = sum(r[keys.TRAIN_TIME] for r in records)
        rollout = float(np.median([r[keys.ROLLOUT_TIME] for r in records])) if records else math.nan
        rows.append(
            {
                "key": result.method.key,
                "label": result.method.label,
                "train_s_per_step": train / steps if steps else math.nan,
                "rollout_s_median": rollout,
                "peak_rss_mib": result.peak_rss_mib,
            }
        )
    if rows:
        reference = rows[0]
        for row in rows:
            row["throughput_x"] = reference["train_s_per_step"] / row["train_s_per_step"]
            row["memory_x"] = row["peak_rss_mib"] / reference["peak_rss_mib"]
    return rows


def _cost_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "# Cost: training step time and memory against the weighted sum",
        "",
        "| method | train s/step | x throughput | peak RSS MiB | x memory |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['label']} | {row['train_s_per_step']:.3f} | {row['throughput_x']:.2f} | "
            f"{row['peak_rss_mib']:.0f} | {row['memory_x']:.3f} |"
        )
    lines += [
        "",
        "One run each, same recipe and seed, epochs after the first; measured while other "
        "runs shared the machine, so ratios are indicative (the controlled measurement is "
        "benchmarks/results/trainer_tiny_cpu.md). Paper: 0.97x / 0.56x speed, 1.14x memory.",
    ]
    return lines


# --- plots ---------------------------------------------------------------------------------


def _plots(results: list[RunResult], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves: dict[str, dict[str, list[list[float]]]] = defaultdict(lambda: defaultdict(list))
    for result in results:
        if result.run_dir is None or result.method.ablation:
            continue
        records = read_metrics(result.run_dir)
        for name in TRAIN_REWARDS:
            curves[result.method.label][name].append(
                [_number(r.get(keys.reward_mean(name))) for r in records]
            )
    # rows that trained on none of these rewards (the noise control) have no curve: left
    # out, so they take no colour of the cycle
    plotted = {
        label: per_reward
        for label, per_reward in curves.items()
        if any(np.isfinite(np.array(runs, dtype=float)).any() for runs in per_reward.values())
    }
    figure, axes = plt.subplots(1, len(TRAIN_REWARDS), figsize=(4 * len(TRAIN_REWARDS), 3.5))
    for axis, name in zip(axes, TRAIN_REWARDS, strict=True):
        for label, per_reward in plotted.items():
            runs = np.array(per_reward[name], dtype=float)
            counts = np.isfinite(runs).sum(axis=0)
            series = np.where(counts > 0, np.nansum(runs, axis=0) / np.maximum(counts, 1), np.nan)
            axis.plot(series, label=label)
        axis.set_title(name)
        axis.set_xlabel("epoch")
    axes[0].legend(fontsize=6)
    figure.tight_layout()
    figure.savefig(out / "curves.png", dpi=120)
    plt.close(figure)

    marble = next((r for r in results if r.method.key == "marble" and r.run_dir), None)
    if marble is not None:
        steps = [s for r in read_metrics(marble.run_dir) for s in r[keys.OPTIMIZER_STEPS]]
        weights = np.array([s[keys.WEIGHTS] for s in steps], dtype=float)
        figure, axis = plt.subplots(figsize=(6, 3.5))
        for k, name in enumerate(TRAIN_REWARDS):
            axis.plot(weights[:, k], label=name)
        axis.set_xlabel("optimizer step")
        axis.set_ylabel("weight on the raw gradient")
        axis.set_yscale("symlog", linthresh=1e-3)
        axis.set_title("MARBLE weights (seed 0)")
        axis.legend(fontsize=7)
        figure.tight_layout()
        figure.savefig(out / "weights.png", dpi=120)
        plt.close(figure)


def _grids(results: list[RunResult], out: Path) -> None:
    folder = out / "grids"
    folder.mkdir(exist_ok=True)
    for result in results:
        grid = result.eval_dir / "grid.png"
        if result.seed == 0 and grid.is_file():
            shutil.copy2(grid, folder / f"{result.method.key}.png")


def _number(value: Any) -> float:
    return float(value) if isinstance(value, int | float) else math.nan


def _machine() -> dict[str, Any]:
    import os

    import torch

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__}  # fmt: skip


def _machine_line(report: dict[str, Any]) -> str:
    m = report["machine"]
    return (
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, CPU only; "
        f"{report['workers']} runs at a time, one thread each; "
        + (
            f"total {report['seconds'] / 60:.1f} min."
            if math.isfinite(report["seconds"])
            else "report rebuilt from finished runs."
        )
    )
