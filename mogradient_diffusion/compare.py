"""Table-1 style comparison of evaluated models: metrics side by side plus a composite.

The composite is the mean over metrics of per-column z-scores across the compared rows
(each metric weighted equally, higher is better for every reward); a metric a row did
not evaluate is left out of that row's mean. Best and second best per column are marked
bold and underlined, as in the MARBLE paper's Table 1.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def read_summary(directory: str | Path) -> dict[str, Any]:
    path = Path(directory).expanduser() / "summary.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{str(directory)!r} has no summary.json; is it an `mogradient-diffusion eval` output?"
        )
    try:
        summary = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error}); re-run the evaluation") from None
    if not isinstance(summary, dict) or not isinstance(summary.get("metrics"), dict):
        raise ValueError(f"{path} has no `metrics` mapping; re-run the evaluation")
    return summary


# Settings that make two evaluations' numbers comparable: the same prompts, sampler
# budget, resolution, images per prompt and seeds.
PROTOCOL = (
    "prompt_file",
    "max_prompts",
    "steps",
    "guidance_scale",
    "resolution",
    "images_per_prompt",
    "seed",
)


def protocol_differences(summaries: Sequence[dict[str, Any]], labels: Sequence[str]) -> list[str]:
    """``key: label=value, ...`` for every protocol setting the rows disagree on."""
    differences = []
    for key in PROTOCOL:
        values = [summary.get("settings", {}).get(key) for summary in summaries]
        if len({json.dumps(value) for value in values}) > 1:
            pairs = ", ".join(
                f"{label}={value}" for label, value in zip(labels, values, strict=True)
            )
            differences.append(f"{key}: {pairs}")
    return differences


# GenEval reports the mean over its tags (single_object, counting, ...), not over images.
TAG_AVERAGED = ("geneval", "geneval_strict")


def metric_value(name: str, entry: dict[str, Any]) -> float:
    """The headline number: GenEval's mean over tags for its metrics, else the image mean."""
    value = entry.get("mean_over_tags") if name in TAG_AVERAGED else None
    value = entry.get("mean") if value is None else value
    return math.nan if value is None else float(value)


def composite_scores(table: list[dict[str, float]], metrics: Sequence[str]) -> list[float]:
    """Row-wise mean of per-column z-scores (population std; a constant column scores 0)."""
    z_rows: list[list[float]] = [[] for _ in table]
    for metric in metrics:
        present = [row[metric] for row in table if not math.isnan(row.get(metric, math.nan))]
        if not present:
            continue
        mean = sum(present) / len(present)
        std = math.sqrt(sum((v - mean) ** 2 for v in present) / len(present))
        for z_row, row in zip(z_rows, table, strict=True):
            value = row.get(metric, math.nan)
            if not math.isnan(value):
                z_row.append(0.0 if std == 0 else (value - mean) / std)
    return [sum(z) / len(z) if z else math.nan for z in z_rows]


def comparison_table(directories: Sequence[str | Path], allow_mixed_settings: bool = False) -> str:
    """Markdown table over the eval outputs in ``directories``, in the given order.

    Rows evaluated under different settings (``PROTOCOL``) are refused unless allowed:
    one composite over them would rank protocols, not models.
    """
    summaries = [read_summary(d) for d in directories]
    metrics = list(dict.fromkeys(m for s in summaries for m in s["metrics"]))
    table = [
        {m: metric_value(m, s["metrics"][m]) if m in s["metrics"] else math.nan for m in metrics}
        for s in summaries
    ]
    labels = [str(s.get("label", d)) for s, d in zip(summaries, directories, strict=True)]
    differences = protocol_differences(summaries, labels)
    if differences and not allow_mixed_settings:
        raise ValueError(
            "these evaluations used different settings ("
            + "; ".join(differences)
            + "); evaluate them alike or pass --allow-mixed-settings"
        )
    lines = ranked_table(labels, table, metrics)
    lines += [
        "",
        "Composite: mean over metrics of per-column z-scores across these rows. "
        "**best**, <u>second</u>.",
    ]
    if differences:
        lines += ["", "Warning: the rows used different settings: " + "; ".join(differences)]
    return "\n".join(lines) + "\n"


def ranked_table(
    labels: Sequence[str],
    table: list[dict[str, float]],
    metrics: Sequence[str],
    texts: Sequence[dict[str, str]] | None = None,
    header: str = "model",
) -> list[str]:
    """Markdown lines: one row per label, the metrics plus the composite, best and second
    best per column marked. ``texts`` may replace a cell's printed number (e.g. mean ± std);
    ``header`` names the label column(s)."""
    table = [dict(row) for row in table]
    for row, composite in zip(table, composite_scores(table, metrics), strict=True):
        row["composite"] = composite
    columns = [*metrics, "composite"]
    marks = {column: rank_marks([row[column] for row in table]) for column in columns}
    lines = [
        f"| {header} | " + " | ".join(columns) + " |",
        "|---" * (header.count("|") + 1) + "|" + "---|" * len(columns),
    ]
    for i, (label, row) in enumerate(zip(labels, table, strict=True)):
        text = texts[i] if texts is not None else {}
        cells = [format_cell(row[c], marks[c].get(i), text.get(c)) for c in columns]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def rank_marks(values: list[float]) -> dict[int, int]:
    """{row index: 1 or 2} for the best and second-best finite values (ties share a rank)."""
    finite = sorted({v for v in values if not math.isnan(v)}, reverse=True)[:2]
    return {i: finite.index(v) + 1 for i, v in enumerate(values) if v in finite}


def format_cell(value: float, rank: int | None, text: str | None = None) -> str:
    """``value`` (or a given ``text`` for it) bold when ranked 1, underlined when 2."""
    if math.isnan(value):
        return "–"
    text = f"{value:.3f}" if text is None else text
    return {1: f"**{text}**", 2: f"<u>{text}</u>"}.get(rank, text)
