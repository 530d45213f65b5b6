"""Evaluation: generate on a prompt set with fixed seeds, score with any rewards, write files.

The protocol of the references: the pipeline's own sampler (40 Euler steps, CFG 1.0;
``eval_inputs.run_defaults`` gives a run's LoRA its run's settings instead), one seed
per image so results do not depend on the batch size, the trained LoRA loaded with
``load_lora_weights``. Scoring of batch i overlaps the generation of batch i+1 (a
one-thread pool, as the references overlap rewards with sampling). Outputs: ``images/``,
``samples.jsonl`` (one line per image), ``summary.json`` / ``summary.md`` (per-metric
mean, std and a bootstrap 95% interval, GenEval-style per-tag means) and ``grid.png``
(the first images, captioned with their prompt and scores).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from tqdm.auto import tqdm

from mogradient.registry import Registry, UnknownNameError
from mogradient_diffusion.evaluation.grid import save_grid
from mogradient_diffusion.evaluation.inputs import check_lora, check_output_dir, resolve_device
from mogradient_diffusion.model import pipeline_files
from mogradient_diffusion.model.families import family_of_pipeline_class
from mogradient_diffusion.model.policy import DTYPES
from mogradient_diffusion.prompts.sources import PromptSource, load_prompt_file
from mogradient_diffusion.rewards import RewardSet, make_reward
from mogradient_diffusion.rewards.background import BackgroundScoring
from mogradient_diffusion.rewards.base import to_uint8_images

PROMPT_SETS_DIR = Path(__file__).parents[1] / "prompts" / "eval_prompts"
PROMPT_SETS: Registry[Path] = Registry("prompt set")
PROMPT_SETS.add("geneval", PROMPT_SETS_DIR / "geneval.jsonl")
PROMPT_SETS.add("ocr", PROMPT_SETS_DIR / "ocr.txt")
PROMPT_SETS.add("general", PROMPT_SETS_DIR / "general.txt")


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
    guidance: float | None = None  # embedded guidance (FLUX.1-dev); None: the family's default
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
        from mogradient_diffusion.rewards import REWARDS
        from mogradient_diffusion.training_config import import_reward_modules

        import_reward_modules(self.reward_modules)
        problems = _range_problems(self)
        if problems:
            raise ValueError("invalid evaluation settings: " + "; ".join(problems))
        if not self.metrics:
            raise ValueError("no metrics given: pass --metrics with reward names")
        for name in self.metrics:
            try:
                REWARDS.canonical(name)
            except UnknownNameError as error:  # it names the closest rewards
                raise ValueError(f"unknown metrics: {error}") from None
        extra = sorted(set(self.metric_options) - set(self.metrics))
        if extra:
            raise ValueError(f"options given for metrics not evaluated: {extra}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        resolve_prompt_set(self.prompts)
        resolve_device(self.device)
        check_output_dir(self.out)
        if self.lora is not None:
            check_lora(self.lora)


POSITIVE = ("steps", "images_per_prompt", "batch_size", "max_prompts", "max_sequence_length")


def _range_problems(settings: EvalSettings) -> list[str]:
    """``--flag must be RULE, got VALUE`` for each setting outside its range."""
    problems = [
        f"--{name.replace('_', '-')} must be >= 1, got {getattr(settings, name)}"
        for name in POSITIVE
        if getattr(settings, name) is not None and getattr(settings, name) < 1
    ]
    # Written as `not x >= 0`, so NaN (which fails every comparison) is refused too.
    if not (settings.guidance_scale >= 0 and math.isfinite(settings.guidance_scale)):
        problems.append(
            f"--guidance-scale must be a finite number >= 0, got {settings.guidance_scale}"
        )
    if settings.guidance is not None and not (
        settings.guidance > 0 and math.isfinite(settings.guidance)
    ):
        problems.append(f"--guidance must be a finite number > 0, got {settings.guidance}")
    size = settings.resolution
    if size is not None and (size <= 0 or size % 16):
        problems.append(f"--resolution must be a positive multiple of 16 (SD3), got {size}")
    return problems


def resolve_prompt_set(name_or_path: str) -> Path:
    """A shipped set's file, or the given path; FileNotFoundError names the choices."""
    if name_or_path in PROMPT_SETS:
        return PROMPT_SETS[name_or_path]
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
    device = resolve_device(settings.device)
    with library_progress_bars(settings.progress):
        pipeline, _ = pipeline_files.load_pipeline(settings.model, DTYPES[settings.dtype])
    if settings.lora is not None:
        load_lora(pipeline, settings.lora, settings.model)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline.to(device)


def load_lora(pipeline, lora: str, model: str) -> None:
    """``load_lora_weights``, with one line for a LoRA that does not fit the model: a size
    mismatch, or layers the model lacks (diffusers would skip those without a word)."""
    expected = sum(".lora_A." in key for key in check_lora(lora))
    misfit = f"the LoRA {lora!r} does not fit the model {model!r}"
    try:
        pipeline.load_lora_weights(Path(lora).expanduser())
    except (RuntimeError, ValueError, KeyError) as error:
        raise ValueError(f"{misfit}: {_brief(error)}") from None
    loaded = sum(".lora_A." in name for name, _ in pipeline.transformer.named_parameters())
    if loaded < expected:
        raise ValueError(f"{misfit}: {expected - loaded} of its {expected} layers are not in it")


def _brief(error: Exception, limit: int = 300) -> str:
    """A library's (often multi-line, very long) message as one bounded line."""
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


@contextmanager
def library_progress_bars(enabled: bool) -> Iterator[None]:
    """diffusers' and transformers' loading bars follow ``--quiet`` like ours."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    modules = (diffusers_logging, transformers_logging)
    before = [module.is_progress_bar_enabled() for module in modules]
    for module in modules:
        module.enable_progress_bar() if enabled else module.disable_progress_bar()
    try:
        yield
    finally:
        for module, was in zip(modules, before, strict=True):
            module.enable_progress_bar() if was else module.disable_progress_bar()


# Library log lines an evaluation would print: diffusers notes that the LoRA has no
# text-encoder weights (ours never do) and warns per batch about truncated prompts
# (``truncated_prompts`` counts them once instead); a LoRA that does not fit is logged
# at length before the error that ``load_lora`` turns into one line.
QUIETED = (
    ("diffusers.loaders.lora_base", "No LoRA keys associated to"),
    ("diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3", "was truncated"),
    ("diffusers.pipelines.flux.pipeline_flux", "was truncated"),
    ("diffusers.loaders.peft", "was unsuccessful with the following error"),
    ("diffusers.utils.peft_utils", "led to unexpected keys found in the model"),
)


@contextmanager
def quiet_library_messages() -> Iterator[None]:
    """Drop the ``QUIETED`` messages while an evaluation runs; every other line passes."""
    filters = [(logging.getLogger(name), _dropping(text)) for name, text in QUIETED]
    for logger, drop in filters:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger, drop in filters:
            logger.removeFilter(drop)


def _dropping(text: str) -> Callable[[logging.LogRecord], bool]:
    return lambda record: text not in record.getMessage()


# A real text encoder's tokenizer has tens of thousands of pieces (CLIP 49408, T5 32100,
# Qwen's 151643); the tiny offline pipelines' (model/tiny*.py) know a few hundred words and
# spell any other letter by letter.
TEST_VOCABULARY = 5000


def truncated_prompts(pipeline, prompts: Sequence[str], max_sequence_length: int) -> int:
    """Distinct prompts that a text encoder cuts short: CLIP at its 77 tokens, the others
    (T5) at ``max_sequence_length``, whichever of the pipeline's tokenizers it has.

    A tiny pipeline's tokenizer spells a word it does not know letter by letter, so every
    shipped prompt would overrun the tiny preset's 32 T5 tokens and the note would be
    noise; there a prompt counts as cut short only when its words alone (one token each,
    the least a real tokenizer takes) overrun the limit.
    """
    from transformers import CLIPTokenizer

    limits = [
        (tokenizer, tokenizer.model_max_length)
        if isinstance(tokenizer, CLIPTokenizer)
        else (tokenizer, max_sequence_length)
        for name, tokenizer in pipeline.components.items()
        if name.startswith("tokenizer") and tokenizer is not None
    ]
    return sum(
        any(_token_count(tokenizer, prompt) > limit for tokenizer, limit in limits)
        for prompt in set(prompts)
    )


def _token_count(tokenizer, prompt: str) -> int:
    if len(tokenizer) >= TEST_VOCABULARY:
        return len(tokenizer(prompt, verbose=False).input_ids)
    specials = len(tokenizer("", verbose=False).input_ids)  # BOS/EOS it adds
    return specials + len(prompt.split())


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


def sample_generator(seed: int, device: torch.device) -> torch.Generator:
    """One sample's generator, on the pipeline's device: one per sample, so an image depends
    on its seed, not on its batch. (The device guard's test swaps in a CPU generator: its
    logical device can have none.)"""
    return torch.Generator(device).manual_seed(seed)


def generate(pipeline, samples: Sequence[Sample], settings: EvalSettings) -> torch.Tensor:
    """Images [B, 3, H, W] in [0, 1] for ``samples`` with the pipeline's own sampler,
    guided as the model's family guides its rollouts."""
    generators = [sample_generator(s.seed, pipeline.device) for s in samples]
    size = settings.resolution
    family = family_of_pipeline_class(type(pipeline).__name__)
    guidance = family.pipeline_guidance(
        pipeline, settings.guidance_scale, settings.guidance, len(samples)
    )
    images = pipeline(
        prompt=[s.prompt for s in samples],
        num_inference_steps=settings.steps,
        height=size,
        width=size,
        generator=generators,
        max_sequence_length=settings.max_sequence_length,
        output_type="pt",
        **guidance,
    ).images
    return images.float().clamp(0, 1).cpu()


def evaluate(settings: EvalSettings) -> Path:
    """Run the whole evaluation; returns the output directory.

    Everything is written to a staging folder first and replaces the previous
    evaluation in ``out`` only at the end: a failed or interrupted run leaves the old
    results whole, and a finished one leaves no stale image beside its ``samples.jsonl``.
    """
    settings.validate()
    source = load_eval_prompts(settings)
    rewards = RewardSet(
        [make_reward(name, **settings.metric_options.get(name, {})) for name in settings.metrics]
    )
    try:
        return _evaluate(settings, source, rewards)
    finally:  # a remote reward's connections and threads
        rewards.close()


def _evaluate(settings: EvalSettings, source: PromptSource, rewards: RewardSet) -> Path:
    out = check_output_dir(settings.out)
    with quiet_library_messages():
        pipeline = load_pipeline(settings)
        rewards.to(pipeline.device)
        # Record the size used, not "the model's default": `compare` matches the numbers.
        native = pipeline.default_sample_size * pipeline.vae_scale_factor
        settings = dataclasses.replace(settings, resolution=settings.resolution or native)
        samples = plan_samples(source, settings.images_per_prompt, settings.seed)
        staging = fresh_staging(out)
        try:
            rows, seconds = generate_and_score(pipeline, rewards, samples, settings, staging)
            summary = summarize(rows, rewards.names)
            prompt_file = str(resolve_prompt_set(settings.prompts))
            summary["settings"] = asdict(settings) | {"prompt_file": prompt_file}
            summary["reward_seconds"] = seconds
            summary["label"] = settings.label or out.name
            summary["truncated_prompts"] = truncated_prompts(
                pipeline, source.prompts, settings.max_sequence_length
            )
            write_outputs(staging, rows, summary, rewards.names)
        except BaseException:  # an interrupt too: leave --out as it was
            discard(staging)
            raise
    with signals_held():  # publish whole: never part old evaluation, part new
        publish(staging, out)
    clip_limit = pipeline.tokenizer.model_max_length
    _note_truncation(summary["truncated_prompts"], len(source), clip_limit, settings)
    return out


def generate_and_score(
    pipeline, rewards: RewardSet, samples: Sequence[Sample], settings: EvalSettings, out: Path
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Generate batch by batch into ``out/images`` while the previous batch is scored."""
    scoring = BackgroundScoring(rewards, [s.prompt for s in samples], [s.metadata for s in samples])
    try:
        generate_into(pipeline, samples, settings, out, scoring.submit)
        values, seconds = scoring.collect()
    finally:  # stopped early (Ctrl-C, an error): drop the batches not yet scored
        scoring.close()
    rows = [
        sample_row(sample, rewards.names, scores)
        for sample, scores in zip(samples, values.tolist(), strict=True)
    ]
    return rows, seconds


def generate_into(
    pipeline,
    samples: Sequence[Sample],
    settings: EvalSettings,
    out: Path,
    on_images: Callable[[slice, torch.Tensor], None],
) -> None:
    """Generate batch by batch into ``out/images``, handing each batch to ``on_images``."""
    with tqdm(total=len(samples), desc="eval", unit="img", disable=not settings.progress) as bar:
        for start in range(0, len(samples), settings.batch_size):
            batch = samples[start : start + settings.batch_size]
            images = generate(pipeline, batch, settings)
            on_images(slice(start, start + len(batch)), images)
            for sample, image in zip(batch, to_uint8_images(images), strict=True):
                Image.fromarray(image).save(out / image_path(sample))
            bar.update(len(batch))


def write_outputs(
    out: Path, rows: Sequence[dict[str, Any]], summary: dict[str, Any], metrics: Sequence[str]
) -> None:
    """``samples.jsonl``, ``summary.json``/``.md`` and the captioned ``grid.png``."""
    with (out / "samples.jsonl").open("w") as lines:
        lines.writelines(json.dumps(row) + "\n" for row in rows)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "summary.md").write_text(summary_markdown(summary))
    save_grid(rows[:16], metrics, out, out / "grid.png")


def _note_truncation(count: int, prompts: int, clip_limit: int, settings: EvalSettings) -> None:
    """One line for what diffusers would warn about batch after batch."""
    if count:
        print(
            f"mogradient-diffusion eval: note: {count} of {prompts} prompts were cut short by "
            f"the text encoders (CLIP: {clip_limit} tokens, T5: --max-sequence-length "
            f"{settings.max_sequence_length})",
            file=sys.stderr,
        )


STAGING = ".eval-in-progress"
OUTPUT_FILES = ("samples.jsonl", "summary.json", "summary.md", "grid.png")
IMAGE_NAME = re.compile(r"\d{5}\.png")


def fresh_staging(out: Path) -> Path:
    """An empty ``out/.eval-in-progress/images`` (a killed run's leftovers removed)."""
    staging = out / STAGING
    if staging.exists():
        shutil.rmtree(staging)
    (staging / "images").mkdir(parents=True)
    return staging


def discard(staging: Path) -> None:
    """Remove a failed run's staging folder, and ``out`` if that leaves it empty."""
    shutil.rmtree(staging, ignore_errors=True)
    if not any(staging.parent.iterdir()):
        staging.parent.rmdir()


@contextmanager
def signals_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait until the block ends, then reach the handler they would have
    reached: what the block writes is never left half-done."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers, and only it runs them
        return
    held: list[int] = []
    stops = (signal.SIGINT, signal.SIGTERM)
    previous = {number: signal.signal(number, lambda n, _: held.append(n)) for number in stops}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        if held:
            signal.raise_signal(held[0])


def publish(staging: Path, out: Path) -> None:
    """Replace the evaluation files in ``out`` by those in ``staging``.

    Only what an evaluation writes is removed (``images/NNNNN.png`` and ``OUTPUT_FILES``):
    another file a user keeps in ``out`` stays.
    """
    images = out / "images"
    images.mkdir(exist_ok=True)
    for old in images.iterdir():
        if IMAGE_NAME.fullmatch(old.name):
            old.unlink()
    for new in (staging / "images").iterdir():
        new.replace(images / new.name)
    for name in OUTPUT_FILES:
        if (staging / name).exists():
            (staging / name).replace(out / name)
        else:
            (out / name).unlink(missing_ok=True)
    shutil.rmtree(staging)


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
    """Per metric: mean, std, n, n not applicable, 95% interval; per GenEval tag: means.

    What a sample this small cannot give (a std or an interval from one value) is null,
    not NaN: NaN is no JSON, and the tables print it as unavailable.
    """
    result: dict[str, Any] = {"images": len(rows), "metrics": {}}
    for name in metrics:
        values = np.array([row[name] for row in rows if row[name] is not None], dtype=np.float64)
        entry = {
            "mean": float(values.mean()) if len(values) else None,
            "std": float(values.std(ddof=1)) if len(values) > 1 else None,
            "n": len(values),
            "not_applicable": len(rows) - len(values),
            "ci95": [_finite_or_none(bound) for bound in bootstrap_interval(values)],
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


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def number_text(value: float | None) -> str:
    """A table cell: the number, or ``n/a`` where there is none."""
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.4f}"


def interval_text(entry: Mapping[str, Any]) -> str:
    """``[low, high]``, or why there is no interval (fewer than two values)."""
    low, high = entry.get("ci95") or (None, None)
    if low is None or high is None or not (math.isfinite(low) and math.isfinite(high)):
        return f"n/a (n={entry.get('n', 0)})"
    return f"[{low:.4f}, {high:.4f}]"


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
        lines.append(
            f"| {name} | {number_text(entry['mean'])} | {interval_text(entry)} "
            f"| {number_text(entry['std'])} | {entry['n']} | {entry['not_applicable']} |"
        )
    for name, entry in summary["metrics"].items():
        if "by_tag" in entry:
            lines += ["", f"{name} by tag (mean over tags {entry['mean_over_tags']:.4f}):", ""]
            lines += [f"- {tag}: {value:.4f}" for tag, value in entry["by_tag"].items()]
    return "\n".join(lines) + "\n"
