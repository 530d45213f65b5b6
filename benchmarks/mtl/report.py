"""table.md: one table per problem (per-task test metrics, Δm%, step time, conflict share)."""

from __future__ import annotations

from benchmarks.common import machine_markdown, markdown_table


def _metric(task: dict, mean: float, std: float) -> str:
    if task["metric"] == "accuracy":
        return f"{100 * mean:.1f} ± {100 * std:.1f}"
    return f"{mean:.2f} ± {std:.2f}"


def _share(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.0f}%"


def problem_table(summary: dict) -> str:
    tasks = summary["tasks"]
    header = ["method", "library"]
    header += [
        f"{task['name']} {'acc %' if task['metric'] == 'accuracy' else task['metric']} "
        f"{'↑' if task['higher_is_better'] else '↓'}"
        for task in tasks
    ]
    header += ["Δm% ↓", "step time ÷ EW", "steps with cos_min < 0"]
    methods = summary["methods"]
    others = [label for label in methods if label != "single-task"]
    order = ["single-task", *sorted(others, key=lambda label: methods[label]["delta_m"][0])]
    rows = []
    for label in order:
        entry = methods[label]
        timing = summary.get("timing", {}).get(label)
        row = [label, entry["library"] if entry["library"] != "baseline" else "–"]
        row += [_metric(task, *entry["test"][k]) for k, task in enumerate(tasks)]
        row.append(f"{entry['delta_m'][0]:+.2f} ± {entry['delta_m'][1]:.2f}")
        row.append("–" if timing is None else f"{timing['ratio_to_ew']:.2f}")
        row.append(_share(entry["negative_cos_min_share"]))
        rows.append(row)
    return markdown_table(header, rows)


def sweep_table(summary: dict) -> str:
    tasks = summary["tasks"]
    header = ["sweep", "preference"] + [f"{task['name']} acc %" for task in tasks] + ["Δm% ↓"]
    rows = []
    for kind, entries in summary["sweeps"].items():
        for entry in sorted(entries, key=lambda e: e["preference"][0]):
            preference = "(" + ", ".join(f"{p:.1f}" for p in entry["preference"]) + ")"
            row = [kind, preference]
            row += [_metric(task, *entry["test"][k]) for k, task in enumerate(tasks)]
            row.append(f"{entry['delta_m'][0]:+.2f} ± {entry['delta_m'][1]:.2f}")
            rows.append(row)
    return markdown_table(header, rows)


def table_markdown(results: dict) -> str:
    settings = results["settings"]
    budget = settings["budget"]
    lines = [
        f"# Multi-task head-to-head on scikit-learn digits ({results['mode']} run)",
        "",
        f"{len(settings['seeds'])} seeds; every method: Adam lr {budget['learning_rate']}, "
        f"batch {budget['batch']}, {budget['epochs']} epochs of {settings['sizes'][0]} "
        f"training examples; the epoch is chosen on validation ({settings['sizes'][1]} "
        f"examples; Δm% for multi-task runs, the task's metric for single-task runs) and "
        f"reported on test ({settings['sizes'][2]} examples). Mean ± sample std over seeds. "
        "Δm% = mean over tasks of the signed relative change vs the single-task models "
        "(negative = better than single-task). Step time: median of one interleaved run "
        "(all methods, same batches, 1 thread), divided by mogradient's equal weighting. "
        "cos_min: worst cosine between the trunk update and a task's trunk gradient, every "
        f"{budget['diagnostics_every']} steps.",
        "",
        f"Wall time: {results['total_seconds'] / 60:.1f} min in all "
        f"({results['training_seconds'] / 60:.1f} min of training on {results['workers']} "
        "worker processes).",
        "",
        machine_markdown(results["machine"]),
        "",
    ]
    for name, summary in results["problems"].items():
        lines += [f"## {name}", "", problem_table(summary), ""]
        if summary["sweeps"]:
            lines += [
                f"### {name}: preference sweeps (Pareto front, {len(settings['sweep_seeds'])} "
                "seeds)",
                "",
                sweep_table(summary),
                "",
            ]
    return "\n".join(lines)
