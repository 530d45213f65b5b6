"""Evaluation: generate on a prompt set with fixed seeds, score with any rewards, write files.

The protocol of the references: the pipeline's own sampler (40 Euler steps, CFG 1.0),
one seed per image so results do not depend on the batch size, the trained LoRA loaded
with ``load_lora_weights``. Scoring of batch i overlaps the generation of batch i+1 (a
one-thread pool, as the references overlap rewards with sampling). Outputs: ``images/``,
``samples.jsonl`` (one line per image), ``summary.json`` / ``summary.md`` (per-metric
mean, std and a bootstrap 95% interval, GenEval-style per-tag means) and ``grid.png``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from tqdm.auto import tqdm

from mogradient_diffusion.policy import DTYPES, load_sd3_pipeline
from mogradient_diffusion.prompts import PromptSource, load_prompt_file
from mogradient_diffusion.rewards import RewardSet, make_reward
from mogradient_diffusion.rewards.background import BackgroundScoring
from mogradient_diffusion.rewards.base import to_uint8_images

PROMPT_SETS_DIR = Path(__file__).with_name("eval_prompts")
PROMPT_SETS = {"geneval": "geneval.jsonl", "ocr": "ocr.txt", "general": "general.txt"}


@dataclass
class EvalSettings:
    model: str
    prompts: str  # a shipped set name (PROMPT_SETS) or a prompt file path
    metrics: list[str]
    out: str
    lora: str | None = None
    metric_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    steps: int = 40
    guidance_scale: float = 1.0
    resolution: int | None = None  # None: the pipeline's default size
    max_sequence_length: int = 256  # T5 tokens; match the value the model was trained with
    images_per_prompt: int = 1
    max_prompts: int | None = None
    seed: int = 0
    batch_size: int = 8
    device: str = "auto"
    dtype: str = "float32"
    label: str | None = None  # row name in `compare`; default: the output folder's name
    progress: bool = True
    reward_modules: list[str] = field(default_factory=list)  # where user rewards register

    def validate(self) -> None:
        """Fail before any model loads: bad numbers, unknown metrics, missing prompt file."""
        from mogradient_diffusion.config import import_reward_modules
        from mogradient_diffusion.rewards import REWARDS

        import_reward_modules(self.reward_modules)
        checks = {
            "steps": self.steps >= 1,
            "images_per_prompt": self.images_per_prompt >= 1,
            "batch_size": self.batch_size >= 1,
            "guidance_scale": self.guidance_scale >= 0,
            "max_prompts": self.max_prompts is None or self.max_prompts >= 1,
            "resolution": self.resolution is None or self.resolution > 0,
            "max_sequence_length": self.max_sequence_length >= 1,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid evaluation settings: {', '.join(bad)} out of range")
        if not self.metrics:
            raise ValueError("no metrics given: pass --metrics with reward names")
        unknown = sorted(set(self.metrics) - set(REWARDS))
        if unknown:
            raise ValueError(f"unknown metrics {unknown}; available: {', '.join(sorted(REWARDS))}")
        extra = sorted(set(self.metric_options) - set(self.metrics))
        if extra:
            raise ValueError(f"options given for metrics not evaluated: {extra}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        resolve_prompt_set(self.prompts)


def resolve_prompt_set(name_or_path: str) -> Path:
    """A shipped set's file, or the given path; FileNotFoundError names the choices."""
    if name_or_path in PROMPT_SETS:
        return PROMPT_SETS_DIR / PROMPT_SETS[name_or_path]
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"prompt set {name_or_path!r} is neither a shipped set ({', '.join(PROMPT_SETS)}) "
            "nor an existing file"
        )
    return path


def load_eval_prompts(settings: EvalSettings) -> PromptSource:
    source = load_prompt_file(resolve_prompt_set(settings.prompts))
    if settings.max_prompts is None:
        return source
    count = settings.max_prompts
    return PromptSource(source.name, source.prompts[:count], source.metadata[:count])


def load_pipeline(settings: EvalSettings):
    """The base pipeline (plus the LoRA), on the evaluation device, progress bars off."""
    from mogradient_diffusion.distributed import World

    device = World.from_environment(settings.device).device
    pipeline = load_sd3_pipeline(settings.model, DTYPES[settings.dtype])
    if settings.lora is not None:
        lora = Path(settings.lora).expanduser()
        if not lora.is_dir():
            raise FileNotFoundError(f"LoRA directory {str(lora)!r} does not exist")
        pipeline.load_lora_weights(lora)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline.to(device)


@dataclass
class Sample:
    index: int
    prompt_index: int
    seed: int
    prompt: str
    metadata: Mapping[str, Any]


def plan_samples(source: PromptSource, images_per_prompt: int, seed: int) -> list[Sample]:
    """Every image to generate, each with its own seed (``seed + index``)."""
    samples = []
    for p, (prompt, metadata) in enumerate(zip(source.prompts, source.metadata, strict=True)):
        for j in range(images_per_prompt):
            index = p * images_per_prompt + j
            samples.append(Sample(index, p, seed + index, prompt, metadata))
    return samples


def generate(pipeline, samples: Sequence[Sample], settings: EvalSettings) -> torch.Tensor:
    """Images [B, 3, H, W] in [0, 1] for ``samples`` with the pipeline's own sampler."""
    device = pipeline.device
    generators = [torch.Generator(device).manual_seed(s.seed) for s in samples]
    size = settings.resolution
    images = pipeline(
        prompt=[s.prompt for s in samples],
        num_inference_steps=settings.steps,
        guidance_scale=settings.guidance_scale,
        height=size,
        width=size,
        generator=generators,
        max_sequence_length=settings.max_sequence_length,
        output_type="pt",
    ).images
    return images.float().clamp(0, 1).cpu()


def evaluate(settings: EvalSettings) -> Path:
    """Run the whole evaluation; returns the output directory."""
    settings.validate()
    source = load_eval_prompts(settings)
    rewards = RewardSet(
        [make_reward(name, **settings.metric_options.get(name, {})) for name in settings.metrics]
    )
    pipeline = load_pipeline(settings)
    rewards.to(pipeline.device)
    out = Path(settings.out).expanduser()
    (out / "images").mkdir(parents=True, exist_ok=True)
    samples = plan_samples(source, settings.images_per_prompt, settings.seed)
    scoring = BackgroundScoring(rewards, [s.prompt for s in samples], [s.metadata for s in samples])
    with tqdm(total=len(samples), desc="eval", unit="img", disable=not settings.progress) as bar:
        for start in range(0, len(samples), settings.batch_size):
            batch = samples[start : start + settings.batch_size]
            images = generate(pipeline, batch, settings)
            scoring.submit(slice(start, start + len(batch)), images)
            for sample, image in zip(batch, to_uint8_images(images), strict=True):
                Image.fromarray(image).save(out / image_path(sample))
            bar.update(len(batch))
    values, seconds = scoring.collect()
    rows = [
        sample_row(sample, rewards.names, scores)
        for sample, scores in zip(samples, values.tolist(), strict=True)
    ]
    with (out / "samples.jsonl").open("w") as lines:
        lines.writelines(json.dumps(row) + "\n" for row in rows)
    summary = summarize(rows, rewards.names)
    prompt_file = str(resolve_prompt_set(settings.prompts))
    summary["settings"] = asdict(settings) | {"prompt_file": prompt_file}
    summary["reward_seconds"] = seconds
    summary["label"] = settings.label or out.name
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "summary.md").write_text(summary_markdown(summary))
    save_grid([out / row["image"] for row in rows[:16]], out / "grid.png")
    return out


def image_path(sample: Sample) -> str:
    return f"images/{sample.index:05d}.png"


def sample_row(sample: Sample, names: Sequence[str], scores: Sequence[float]) -> dict[str, Any]:
    """One JSONL line: the sample, its image file and its scores (null: not applicable)."""
    return {
        "index": sample.index,
        "prompt_index": sample.prompt_index,
        "seed": sample.seed,
        "prompt": sample.prompt,
        "tag": sample.metadata.get("tag"),
        "image": image_path(sample),
        **{name: None if math.isnan(v) else v for name, v in zip(names, scores, strict=True)},
    }


def bootstrap_interval(
    values: np.ndarray, level: float = 0.95, resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean (no normality assumption, no SciPy)."""
    if len(values) < 2:
        return (math.nan, math.nan)
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), (resamples, len(values)))].mean(axis=1)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(low), float(high)


def summarize(rows: Sequence[Mapping[str, Any]], metrics: Sequence[str]) -> dict[str, Any]:
    """Per metric: mean, std, n, n not applicable, 95% interval; per GenEval tag: means."""
    result: dict[str, Any] = {"images": len(rows), "metrics": {}}
    for name in metrics:
        values = np.array([row[name] for row in rows if row[name] is not None], dtype=np.float64)
        low, high = bootstrap_interval(values)
        entry = {
            "mean": float(values.mean()) if len(values) else math.nan,
            "std": float(values.std(ddof=1)) if len(values) > 1 else math.nan,
            "n": len(values),
            "not_applicable": len(rows) - len(values),
            "ci95": [low, high],
        }
        tags = sorted({row["tag"] for row in rows if row.get("tag") and row[name] is not None})
        if tags:
            by_tag = {
                tag: float(
                    np.mean([r[name] for r in rows if r["tag"] == tag and r[name] is not None])
                )
                for tag in tags
            }
            entry["by_tag"] = by_tag
            entry["mean_over_tags"] = float(np.mean(list(by_tag.values())))
        result["metrics"][name] = entry
    return result


def summary_markdown(summary: Mapping[str, Any]) -> str:
    settings = summary["settings"]
    lines = [
        f"# Evaluation: {summary['label']}",
        "",
        f"Model `{settings['model']}`, LoRA `{settings['lora']}`, prompts `{settings['prompts']}`, "
        f"{summary['images']} images, {settings['steps']} steps, CFG {settings['guidance_scale']}, "
        f"seed {settings['seed']}.",
        "",
        "| metric | mean | 95% CI | std | n | n/a |",
        "|---|---|---|---|---|---|",
    ]
    for name, entry in summary["metrics"].items():
        low, high = entry["ci95"]
        lines.append(
            f"| {name} | {entry['mean']:.4f} | [{low:.4f}, {high:.4f}] | {entry['std']:.4f} "
            f"| {entry['n']} | {entry['not_applicable']} |"
        )
    for name, entry in summary["metrics"].items():
        if "by_tag" in entry:
            lines += ["", f"{name} by tag (mean over tags {entry['mean_over_tags']:.4f}):", ""]
            lines += [f"- {tag}: {value:.4f}" for tag, value in entry["by_tag"].items()]
    return "\n".join(lines) + "\n"


def save_grid(paths: Sequence[Path], target: Path, columns: int = 4) -> None:
    """Tile images (same size) into one PNG, row by row."""
    if not paths:
        return
    tiles = [Image.open(path).convert("RGB") for path in paths]
    width, height = tiles[0].size
    rows = -(-len(tiles) // columns)
    grid = Image.new("RGB", (width * min(columns, len(tiles)), height * rows), "white")
    for i, tile in enumerate(tiles):
        grid.paste(tile.resize((width, height)), ((i % columns) * width, (i // columns) * height))
    grid.save(target)
