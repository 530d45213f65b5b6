"""The solve-scope frontier: how often each setting's updates conflict with a reward on the
whole step, against what it costs, and what it learns.

Reads the runs of ``benchmark --mode solve_scope`` (``metrics.jsonl``, ``summary.json``)
and writes ``frontier.json``, ``frontier.md`` and ``frontier.png`` beside the head-to-head's
tables. Per setting:

- conflict: on seed 0 (the conflict probe, every optimizer step), the share of updates
  whose worst cosine with a reward's *whole-step* gradient is negative, with a Wilson 95%
  interval over the steps, and the mean worst cosine;
- cost: optimizer steps per second of training (the probe's time taken out) and whole
  epochs per second (rollout and scoring in), each as a ratio to the weighted sum's mean,
  mean and std over seeds; and, where ``benchmarks/results/solve_scope_cost.json`` exists
  (``bench_engine_cost.py --solve-scope``: one process at a time, interleaved rounds, the
  fastest), its ratios, which the plot and the recommendation use: the runs above shared
  the machine two at a time with whatever else ran;
- learning: each trained reward on the held-out prompts, in pooled seed stds against the
  weighted sum, the exact every-step solve and the pure-noise control.

The recommended setting is the cheapest one (training throughput) whose updates conflict on
at most 5% of steps and whose held-out rewards are none worse than the exact every-step
solve's by more than one pooled seed std.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.mini.report import _method_rows, step_cosines
from benchmarks.mini.runs import RunResult
from miniature.recipe import TRAIN_REWARDS
from mogradient_diffusion.runs import metric_keys as keys
from mogradient_diffusion.runs.metrics_log import read_metrics

REFERENCE = "weighted_sum"
EXACT = "step_every"
CONTROL = "noise_control"
CONFLICT_LIMIT = 0.05
THROUGHPUT_GOAL = 0.95
COST_FILE = Path(__file__).resolve().parents[1] / "results" / "solve_scope_cost.json"


def wilson_interval(hits: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion (sound near 0, where a normal one is not)."""
    if total == 0:
        return math.nan, math.nan
    share = hits / total
    centre = (share + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(share * (1 - share) / total + z * z / (4 * total * total))
    half /= 1 + z * z / total
    return max(0.0, centre - half), min(1.0, centre + half)


def run_timing(run_dir: Path) -> dict[str, float]:
    """Training seconds per optimizer step and seconds per epoch, the probe's time out."""
    train = epoch = 0.0
    steps = epochs = 0
    for record in read_metrics(run_dir):
        probe = record.get(keys.PROBE_TIME, 0.0)
        training = record["time/train"] - probe
        train += training
        epoch += record["time/rollout"] + record["time/reward"] + training
        steps += len(record[keys.OPTIMIZER_STEPS])
        epochs += 1
    return {"steps_per_second": steps / train, "epochs_per_second": epochs / epoch}


def conflict(run_dir: Path) -> dict[str, Any]:
    """The worst-reward cosines of one probed run: every step, and its solve share."""
    steps = [s for s in step_cosines(run_dir) if s["cos_min"] is not None]
    lows = np.array([s["cos_min"] for s in steps])
    hits = int((lows < 0).sum())
    low, high = wilson_interval(hits, len(lows))
    return {
        "steps": len(lows),
        "conflict_share": hits / len(lows) if len(lows) else math.nan,
        "conflict_interval": [low, high],
        "mean_min_cos": float(lows.mean()) if len(lows) else math.nan,
        "solve_share": float(np.mean([s["solved"] for s in steps])) if steps else math.nan,
    }


def separations(rows: dict[str, dict[str, Any]], key: str, against: str) -> dict[str, float] | None:
    """Per trained reward: (row - against) in pooled seed stds."""
    if against not in rows or key == against:
        return None
    row, other = rows[key], rows[against]
    result = {}
    for reward in TRAIN_REWARDS:
        pooled = math.sqrt((row["std"][reward] ** 2 + other["std"][reward] ** 2) / 2)
        difference = row["mean"][reward] - other["mean"][reward]
        result[reward] = difference / pooled if pooled > 0 else math.nan
    return result


def frontier_rows(results: list[RunResult]) -> list[dict[str, Any]]:
    """One row per trained setting (the control and base excluded from the frontier)."""
    held_out = {row["key"]: row for row in _method_rows(results, list(TRAIN_REWARDS))}
    timings: dict[str, list[dict[str, float]]] = {}
    for result in results:
        if result.run_dir is not None and result.method.key != CONTROL:
            timings.setdefault(result.method.key, []).append(run_timing(result.run_dir))
    reference = {
        name: float(np.mean([t[name] for t in timings.get(REFERENCE, [])]))
        for name in ("steps_per_second", "epochs_per_second")
    }
    rows = []
    for key, runs in timings.items():
        first = next(r for r in results if r.method.key == key and r.seed == 0)
        train_ratio = [t["steps_per_second"] / reference["steps_per_second"] for t in runs]
        epoch_ratio = [t["epochs_per_second"] / reference["epochs_per_second"] for t in runs]
        rows.append(
            {
                "key": key,
                "label": first.method.label,
                "seeds": len(runs),
                **conflict(first.run_dir),
                "train_throughput": [float(np.mean(train_ratio)), _std(train_ratio)],
                "epoch_throughput": [float(np.mean(epoch_ratio)), _std(epoch_ratio)],
                "held_out": {r: held_out[key]["mean"][r] for r in TRAIN_REWARDS},
                "held_out_std": {r: held_out[key]["std"][r] for r in TRAIN_REWARDS},
                "versus_weighted_sum": separations(held_out, key, REFERENCE),
                "versus_exact": separations(held_out, key, EXACT),
                "versus_control": separations(held_out, key, CONTROL),
            }
        )
    return rows


def with_bench_costs(rows: list[dict[str, Any]], cost_file: Path) -> None:
    """Add the side-by-side cost bench's ratios (``bench_train``, ``bench_epoch``) to the
    rows it timed."""
    if not cost_file.is_file():
        return
    timed = {entry["row"]["strategy"]: entry for entry in json.loads(cost_file.read_text())["rows"]}
    for row in rows:
        entry = timed.get(row["key"])
        if entry is not None:
            row["bench_train"] = entry["train_throughput"]
            row["bench_epoch"] = entry["epoch_throughput"]


def throughput(row: dict[str, Any]) -> float:
    """Training throughput against the weighted sum: the cost bench's where it timed the
    row, else the runs' mean."""
    return row.get("bench_train", row["train_throughput"][0])


def recommended(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The cheapest row with <= 5% conflicting updates and no held-out reward below the
    exact every-step solve's by more than one pooled seed std (the exact row qualifies by
    its own conflicts)."""
    admissible = [
        row
        for row in rows
        if row["conflict_share"] <= CONFLICT_LIMIT
        and all(v >= -1 for v in (row["versus_exact"] or {}).values() if math.isfinite(v))
    ]
    return max(admissible, key=throughput, default=None)


def _std(values: list[float]) -> float:
    return float(np.std(values, ddof=1)) if len(values) > 1 else math.nan


def frontier_table(rows: list[dict[str, Any]], choice: dict[str, Any] | None) -> list[str]:
    lines = [
        "# Solve scope: conflict against cost",
        "",
        "| setting | conflicting updates (seed 0) | mean worst cos | solve steps "
        "| training throughput (bench) | epoch throughput (bench) | training throughput "
        "(runs) | epoch throughput (runs) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in sorted(rows, key=lambda r: -throughput(r)):
        low, high = row["conflict_interval"]
        bench = [f"{row[k]:.2f}x" if k in row else "-" for k in ("bench_train", "bench_epoch")]
        lines.append(
            f"| {row['label']} | {100 * row['conflict_share']:.1f}% "
            f"({100 * low:.1f}-{100 * high:.1f}) of {row['steps']} | "
            f"{row['mean_min_cos']:+.3f} | {100 * row['solve_share']:.0f}% | "
            f"{bench[0]} | {bench[1]} | "
            f"{_ratio(row['train_throughput'])} | {_ratio(row['epoch_throughput'])} |"
        )
    lines += [
        "",
        "Conflicting: the update's worst cosine with a reward's whole-step gradient is "
        "negative (the conflict probe: every optimizer step of seed 0, 95% Wilson interval "
        "over its steps). Throughput: ratio to the weighted sum; bench: "
        "`bench_engine_cost.py --solve-scope` (one process at a time, rounds interleaved, "
        "each row's fastest; `solve_scope_cost.md`); runs: these runs' own timers, mean ± "
        "std over seeds, two runs sharing the machine at a time. Training excludes the "
        "probe's time; epochs include rollout and scoring.",
        "",
    ]
    for title, field in (
        ("Held-out rewards against the weighted sum (pooled seed stds)", "versus_weighted_sum"),
        ("Held-out rewards against the exact every-step solve (pooled seed stds)", "versus_exact"),
        ("Held-out rewards against the pure-noise control (pooled seed stds)", "versus_control"),
    ):
        lines += [f"## {title}", "", "| setting | " + " | ".join(TRAIN_REWARDS) + " |"]
        lines.append("|---|" + "---|" * len(TRAIN_REWARDS))
        for row in rows:
            if row[field] is not None:
                cells = " | ".join(f"{row[field][r]:+.1f}" for r in TRAIN_REWARDS)
                lines.append(f"| {row['label']} | {cells} |")
        lines.append("")
    lines.append(
        "Recommended (cheapest with <= 5% conflicting updates and no held-out reward more "
        "than 1 sd below the exact every-step solve): "
        + (f"**{choice['label']}**" if choice else "none of these settings")
        + "."
    )
    return lines


def _ratio(value: list[float]) -> str:
    mean, std = value
    return f"{mean:.2f}x ± {std:.2f}" if math.isfinite(std) else f"{mean:.2f}x"


def frontier_plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Conflict rate against training throughput, one point per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(10, 5.5))
    markers = "osD^v<>ph*"
    for index, row in enumerate(sorted(rows, key=lambda r: r["conflict_share"])):
        x, x_std = row["train_throughput"]
        if "bench_train" in row:  # one measurement, no seed spread
            x, x_std = row["bench_train"], math.nan
        y = 100 * row["conflict_share"]
        low, high = (100 * v for v in row["conflict_interval"])
        axes.errorbar(
            x, y, xerr=0 if not math.isfinite(x_std) else x_std,
            yerr=[[y - low], [high - y]], fmt=markers[index % len(markers)], capsize=3,
            label=f"{row['label']} ({100 * row['conflict_share']:.0f}%, {x:.2f}x)",
        )  # fmt: skip
    axes.axhline(100 * CONFLICT_LIMIT, color="grey", linestyle="--", linewidth=0.8)
    axes.axvline(THROUGHPUT_GOAL, color="grey", linestyle=":", linewidth=0.8)
    axes.set_xlabel("training throughput, x weighted sum (side-by-side cost bench)")
    axes.set_ylabel("updates conflicting with a reward on the whole step (%)")
    axes.set_title("How much of the step must the solve see? (goal: lower right corner)")
    axes.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    figure.tight_layout()
    figure.savefig(path, dpi=130)
    plt.close(figure)


def write_frontier(
    results: list[RunResult], out: Path, cost_file: Path = COST_FILE
) -> dict[str, Any]:
    """frontier.json, frontier.md and frontier.png in ``out``; returns the report."""
    rows = frontier_rows([r for r in results if r.method.trains])
    with_bench_costs(rows, cost_file)
    choice = recommended(rows)
    report = {"rows": rows, "recommended": choice["key"] if choice else None}
    (out / "frontier.json").write_text(json.dumps(report, indent=2))
    (out / "frontier.md").write_text("\n".join(frontier_table(rows, choice)) + "\n")
    frontier_plot(rows, out / "frontier.png")
    return report
