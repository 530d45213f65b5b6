"""Table-1 style comparison of evaluated models: metrics side by side plus a composite.

Rows are comparable only when evaluated alike: the same prompts, sampler budget,
resolution, sequence length, dtype, seeds and, per metric, the same reward options
(``color_match`` at another ``min_share`` is another metric). Differences are refused
unless allowed, and then printed under the table.

The composite is an effect size against the first row (the reference, e.g. the base
model): per metric, the difference of means in units of the metric's per-image standard
deviation (pooled over the rows), averaged over the metrics that every row has. It does
not depend on which other rows are compared, a metric missing from one row cannot raise
that row's score, and two nearly equal rows score nearly the same (about 0.2 is a small
difference, 0.8 a large one). A value is marked † where it differs from the reference's
by more than their 95% intervals allow (unpaired, hence conservative). Best and second
best per column among the rows after the reference are bold and underlined in markdown,
as in the MARBLE paper's Table 1, and marked (1) and (2) in plain text (the terminal).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
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
# budget, resolution, text length, precision and seeds (and per metric its options).
PROTOCOL = (
    "prompt_file",
    "max_prompts",
    "steps",
    "guidance_scale",
    "guidance",
    "resolution",
    "max_sequence_length",
    "dtype",
    "images_per_prompt",
    "seed",
)


def protocol_differences(summaries: Sequence[dict[str, Any]], labels: Sequence[str]) -> list[str]:
    """``key: label=value, ...`` for every setting the rows disagree on, reward options
    compared among the rows that evaluated that metric."""
    settings = [summary.get("settings") or {} for summary in summaries]
    differences = [_difference(key, labels, [row.get(key) for row in settings]) for key in PROTOCOL]
    for metric in dict.fromkeys(m for summary in summaries for m in summary["metrics"]):
        having = [i for i, summary in enumerate(summaries) if metric in summary["metrics"]]
        options = [(settings[i].get("metric_options") or {}).get(metric, {}) for i in having]
        differences.append(_difference(f"{metric} options", [labels[i] for i in having], options))
    return [difference for difference in differences if difference]


def _difference(key: str, labels: Sequence[str], values: Sequence[Any]) -> str | None:
    shown = [json.dumps(value, sort_keys=True) for value in values]
    if len(set(shown)) < 2:
        return None
    pairs = zip(labels, shown, strict=True)
    return f"{key}: " + ", ".join(f"{label}={value}" for label, value in pairs)


# GenEval reports the mean over its tags (single_object, counting, ...), not over images.
TAG_AVERAGED = ("geneval", "geneval_strict")


def metric_value(name: str, entry: Mapping[str, Any] | None) -> float:
    """The headline number: GenEval's mean over tags for its metrics, else the image mean
    (NaN for a metric the row did not evaluate)."""
    if entry is None:
        return math.nan
    value = entry.get("mean_over_tags") if name in TAG_AVERAGED else None
    value = entry.get("mean") if value is None else value
    return math.nan if value is None else float(value)


def composite_scores(table: list[dict[str, float]], metrics: Sequence[str]) -> list[float]:
    """Row-wise mean of per-column z-scores (population std; a constant column scores 0).

    The miniature report's composite over its methods' seed means; ``compare`` uses
    ``effect_composite``, which does not depend on the spread of the compared rows.
    """
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


def comparison_table(
    directories: Sequence[str | Path], allow_mixed_settings: bool = False, markdown: bool = True
) -> str:
    """The table over the eval outputs in ``directories``, in the given order (the first
    row is the composite's reference, and not ranked: its composite is 0 by definition);
    markdown, or plain text for a terminal (``markdown=False``).

    Rows evaluated under different settings (``protocol_differences``) are refused unless
    allowed: a composite over them would rank protocols, not models.
    """
    summaries = [read_summary(d) for d in directories]
    labels = [str(s.get("label", d)) for s, d in zip(summaries, directories, strict=True)]
    differences = protocol_differences(summaries, labels)
    if differences and not allow_mixed_settings:
        raise ValueError(
            "these evaluations used different settings ("
            + "; ".join(differences)
            + "); evaluate them alike or pass --allow-mixed-settings"
        )
    metrics = list(dict.fromkeys(m for s in summaries for m in s["metrics"]))
    entries = [[s["metrics"].get(m) for m in metrics] for s in summaries]
    table = [{m: metric_value(m, e) for m, e in zip(metrics, row, strict=True)} for row in entries]
    stds = [{m: _std(e) for m, e in zip(metrics, row, strict=True)} for row in entries]
    composite, used = effect_composite(table, stds, metrics)
    texts = significance_texts(table, entries, metrics)
    lines = ranked_table(
        labels, table, metrics, texts, composite=composite, reference=0, markdown=markdown
    )
    lines += ["", composite_note(labels[0], metrics, used, markdown)]
    if differences:
        lines += ["", "Warning: the rows used different settings: " + "; ".join(differences)]
    return "\n".join(lines) + "\n"


def _std(entry: Mapping[str, Any] | None) -> float:
    value = None if entry is None else entry.get("std")
    return math.nan if value is None else float(value)


def effect_composite(
    table: Sequence[Mapping[str, float]],
    stds: Sequence[Mapping[str, float]],
    metrics: Sequence[str],
) -> tuple[list[float], list[str]]:
    """Per row, the mean over usable metrics of ``(value - reference) / pooled std``, and
    the metrics used: those every row has, with a per-image std in every row and some
    spread (a std of 0 everywhere would make any difference infinite)."""
    used = []
    for metric in metrics:
        values = [row.get(metric, math.nan) for row in table]
        spreads = [row.get(metric, math.nan) for row in stds]
        if all(math.isfinite(v) for v in values + spreads) and max(spreads) > 0:
            used.append(metric)
    if not used:
        return [math.nan] * len(table), used
    pooled = {m: math.sqrt(sum(row[m] ** 2 for row in stds) / len(stds)) for m in used}
    reference = table[0]
    composite = [
        sum((row[m] - reference[m]) / pooled[m] for m in used) / len(used) for row in table
    ]
    return composite, used


def significance_texts(
    table: Sequence[Mapping[str, float]],
    entries: Sequence[Sequence[Mapping[str, Any] | None]],
    metrics: Sequence[str],
) -> list[dict[str, str]]:
    """Cell texts: the value, marked † where it differs from the first row's by more than
    1.96 combined standard errors (each read from its 95% interval)."""
    errors = [[_standard_error(e) for e in row] for row in entries]
    texts = []
    for row, row_errors in zip(table, errors, strict=True):
        cells = {}
        for metric, error, reference_error in zip(metrics, row_errors, errors[0], strict=True):
            gap = abs(row[metric] - table[0][metric])
            combined = math.hypot(error, reference_error)
            mark = "†" if gap > 1.96 * combined else ""  # NaN compares False: no mark
            cells[metric] = f"{row[metric]:.3f}{mark}"
        texts.append(cells)
    return texts


def _standard_error(entry: Mapping[str, Any] | None) -> float:
    """The mean's standard error implied by a 95% interval (NaN without one)."""
    low, high = (entry or {}).get("ci95") or (None, None)
    if low is None or high is None:
        return math.nan
    return (float(high) - float(low)) / (2 * 1.96)


def composite_note(
    reference: str, metrics: Sequence[str], used: Sequence[str], markdown: bool = True
) -> str:
    """What the composite is, and which metrics it leaves out and why."""
    marks = "**best**, <u>second</u>" if markdown else "(1) best, (2) second"
    ranked = f"{marks} among the rows after {reference}."
    if not used:
        return (
            "Composite: none (no metric that every row has comes with a per-image spread). "
            + ranked
        )
    left_out = [m for m in metrics if m not in used]
    text = (
        f"Composite: mean over {', '.join(used)} of the difference to {reference} in units "
        "of the metric's per-image std (pooled over rows); ~0.2 is small, ~0.8 large. "
        f"†: differs from {reference} by more than 1.96 combined standard errors. " + ranked
    )
    if left_out:
        text += (
            " Not in the composite (missing from a row, or no per-image spread to scale by): "
            f"{', '.join(left_out)}."
        )
    return text


def ranked_table(
    labels: Sequence[str],
    table: list[dict[str, float]],
    metrics: Sequence[str],
    texts: Sequence[dict[str, str]] | None = None,
    header: str = "model",
    composite: Sequence[float] | None = None,
    reference: int | None = None,
    markdown: bool = True,
) -> list[str]:
    """Markdown lines (or aligned plain-text ones): one row per label, the metrics plus
    the composite, best and second best per column marked, the ``reference`` row left out
    of that ranking. ``texts`` may replace a cell's printed number (e.g. mean ± std);
    ``header`` names the label column(s); ``composite`` defaults to ``composite_scores``."""
    table = [dict(row) for row in table]
    if composite is None:
        composite = composite_scores(table, metrics)
    for row, score in zip(table, composite, strict=True):
        row["composite"] = score
    columns = [*metrics, "composite"]
    ranked = [i for i in range(len(table)) if i != reference]
    marks = {  # beside a reference, a single row is no one's best
        column: rank_marks(
            [table[i][column] if i in ranked else math.nan for i in range(len(table))]
        )
        if reference is None or len(ranked) > 1
        else {}
        for column in columns
    }
    rows = []
    for i, (label, row) in enumerate(zip(labels, table, strict=True)):
        text = texts[i] if texts is not None else {}
        cells = [format_cell(row[c], marks[c].get(i), text.get(c), markdown) for c in columns]
        rows.append([label, *cells])
    if not markdown:
        return plain_table([header, *columns], rows)
    lines = [
        f"| {header} | " + " | ".join(columns) + " |",
        "|---" * (header.count("|") + 1) + "|" + "---|" * len(columns),
    ]
    return lines + ["| " + " | ".join(cells) + " |" for cells in rows]


def plain_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Columns padded to their widest cell, a dashed rule under the header."""
    widths = [max(len(cells[c]) for cells in [header, *rows]) for c in range(len(header))]
    lines = [header, ["-" * width for width in widths], *rows]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True)).rstrip()
        for cells in lines
    ]


def rank_marks(values: list[float]) -> dict[int, int]:
    """{row index: 1 or 2} for the best and second-best finite values (ties share a rank)."""
    finite = sorted({v for v in values if not math.isnan(v)}, reverse=True)[:2]
    return {i: finite.index(v) + 1 for i, v in enumerate(values) if v in finite}


def format_cell(
    value: float, rank: int | None, text: str | None = None, markdown: bool = True
) -> str:
    """``value`` (or a given ``text`` for it) bold when ranked 1, underlined when 2; in
    plain text followed by ``(1)`` or ``(2)``."""
    if math.isnan(value):
        return "–"
    text = f"{value:.3f}" if text is None else text
    if not markdown:
        return text if rank is None else f"{text} ({rank})"
    return {1: f"**{text}**", 2: f"<u>{text}</u>"}.get(rank, text)
