"""The prompt stream a run trains on: the user's prompt files, or a built-in miniature set.

The built-in set mirrors the paper's mixed sources (general scenes, quoted text,
compositional color prompts) in the tiny vocabulary, so the ``tiny`` preset trains on
the same kind of mixture as the real recipe without any download. Every prompt names a
color, so the preset's ``color_match`` reward applies to each epoch's draw.
"""

from __future__ import annotations

from pathlib import Path

from mogradient_diffusion.config.settings import ConfigError, PromptsConfig
from mogradient_diffusion.prompts.sources import (
    PromptSource,
    StratifiedPromptSampler,
    load_prompt_file,
)

BUILT_IN_SOURCES = (
    PromptSource(
        "general",
        (
            "a photo of a black cat in a room",
            "a painting of a white boat on the sea",
            "a red house next to a tree",
            "a bright city street at blue hour",
        ),
    ),
    PromptSource(
        "text",
        (
            'a green sign saying "open"',
            'a pink book with the word "love"',
            'a cafe sign that reads "hello" on a brown wall',
            'a picture of the text "stop" in orange',
        ),
    ),
    PromptSource(
        "compositional",
        (
            "a red ball next to a blue cup",
            "two green apples on a table",
            "a yellow star above a purple heart",
            "a black dog and a white cat",
        ),
    ),
)


def build_prompt_sampler(config: PromptsConfig, seed: int) -> StratifiedPromptSampler:
    """A stratified sampler over the configured sources (or the built-in set)."""
    if config.directory is None:
        return StratifiedPromptSampler(list(BUILT_IN_SOURCES), seed=seed)
    if not config.sources:
        raise ConfigError(
            "prompts.directory is set but prompts.sources is empty: list {name, file, weight}"
        )
    directory = Path(config.directory)
    sources = []
    for source in config.sources:
        try:
            sources.append(load_prompt_file(directory / source.file, source.name))
        except (OSError, ValueError) as error:  # missing, empty, not UTF-8, bad JSONL
            raise ConfigError(f"prompts.sources {source.name!r}: {error}") from None
    weights = [source.weight for source in config.sources]
    return StratifiedPromptSampler(sources, weights=weights, seed=seed)
