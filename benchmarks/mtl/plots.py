"""PNGs: per-task training curves, cos_min violins, weight shares (mogradient.plotting), fronts."""

from __future__ import annotations

from pathlib import Path

import torch

from mogradient.plotting import (
    plot_cosine_distributions,
    plot_loss_curves,
    plot_weight_trajectories,
)

CURVE_POINTS = 40
FRONT_MARKERS = ("EW", "MGDA-NR", "UPGrad", "TorchJD UPGrad", "LibMTL MGDA-l2", "Nash-MTL")


def _relative_curve(losses: list[list[float]]) -> torch.Tensor:
    """Block means of the per-step losses, each task divided by its first block's mean.

    Relative, because the ink loss starts ~1e5 times above the others.
    """
    values = torch.tensor(losses, dtype=torch.float64)
    block = max(1, len(values) // CURVE_POINTS)
    usable = len(values) // block * block
    means = values[:usable].reshape(-1, block, values.shape[1]).mean(dim=1)
    return means / means[0].clamp_min(1e-12)


def write_all(results: dict, records: list[dict], out: Path) -> list[Path]:
    paths = []
    for name, summary in results["problems"].items():
        task_names = [task["name"] for task in summary["tasks"]]
        runs = [r for r in records if r["problem"] == name and r["kind"] == "method"]
        labels = sorted(
            {r["label"] for r in runs}, key=lambda x: summary["methods"][x]["delta_m"][0]
        )
        curves = {label: [_relative_curve(r["losses"]) for r in runs if r["label"] == label]
                  for label in labels}  # fmt: skip
        paths.append(
            plot_loss_curves(
                curves,
                out / f"curves_{name}.png",
                title=f"{name}: training loss per task / its first value (one line per seed)",
                objective_names=task_names,
            )
        )
        cosines = {label: [v for r in runs if r["label"] == label for v in r["cos_min"]]
                   for label in labels}  # fmt: skip
        paths.append(
            plot_cosine_distributions(
                cosines,
                out / f"cosines_{name}.png",
                title=f"{name}: worst cosine between the trunk update and a task gradient",
            )
        )
        # LibMTL's returned weights mean different things per method (on normalized
        # gradients for MGDA-l2, approximations for PCGrad): plot raw-gradient weights only.
        weighted = [r for r in runs if r["weights"] and r["library"] != "libmtl"]
        weights = {label: [torch.tensor(r["weights"]) for r in weighted if r["label"] == label]
                   for label in labels if any(r["label"] == label for r in weighted)}  # fmt: skip
        paths.append(
            plot_weight_trajectories(
                weights,
                out / f"weights_{name}.png",
                title=f"{name}: weight shares on the raw task gradients (every diagnostics step)",
                objective_names=task_names,
            )
        )
        if summary["sweeps"]:
            paths.append(plot_front(summary, out / f"pareto_{name}.png"))
    return paths


def plot_front(summary: dict, path: Path) -> Path:
    """Test accuracy of task 1 vs task 2 for the preference sweeps and a few methods."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.4, 5.2))
    axes = figure.add_subplot()
    for kind, marker in zip(summary["sweeps"], ("o-", "s--"), strict=False):
        entries = sorted(summary["sweeps"][kind], key=lambda e: e["preference"][0])
        xs = [100 * e["test"][0][0] for e in entries]
        ys = [100 * e["test"][1][0] for e in entries]
        axes.plot(xs, ys, marker, label=f"{kind}, preference (p, 1-p)")
        for entry, x, y in zip(entries, xs, ys, strict=True):
            axes.annotate(f"{entry['preference'][0]:.1f}", (x, y), fontsize=7,
                          textcoords="offset points", xytext=(4, 4))  # fmt: skip
    for label in FRONT_MARKERS:
        entry = summary["methods"].get(label)
        if entry is not None:
            axes.plot(100 * entry["test"][0][0], 100 * entry["test"][1][0], "x", label=label)
    baseline = summary["baseline_test"]
    axes.axvline(100 * baseline[0], color="grey", linewidth=0.8, linestyle=":")
    axes.axhline(100 * baseline[1], color="grey", linewidth=0.8, linestyle=":",
                 label="single-task")  # fmt: skip
    names = [task["name"] for task in summary["tasks"]]
    axes.set_xlabel(f"{names[0]} test accuracy %")
    axes.set_ylabel(f"{names[1]} test accuracy %")
    axes.set_title("Preference sweeps (mean over seeds)")
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return path
