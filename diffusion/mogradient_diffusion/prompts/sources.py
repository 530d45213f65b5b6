"""Prompt sources read from the user's files, and a stratified, resumable sampler over them.

Two formats, the ones the reference trainers use: plain text, one prompt per line
(PickScore, OCR with the target text in double quotes, DrawBench), and GenEval
metadata JSONL (one object per line with ``prompt``, ``tag``, ``include``, optional
``exclude``; the whole object is kept as the prompt's metadata, since the GenEval
reward scores against it). Multi-reward recipes mix sources; the sampler fixes each
batch's share per source, so a small source (OCR) is not drowned by a large one.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np


@dataclass(frozen=True)
class PromptSource:
    """Prompts of one source with one metadata dict per prompt (``{}`` for plain text)."""

    name: str
    prompts: tuple[str, ...]
    metadata: tuple[Mapping[str, Any], ...] = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompts", tuple(self.prompts))
        metadata = tuple(self.metadata) or tuple({} for _ in self.prompts)
        if len(metadata) != len(self.prompts):
            raise ValueError(
                f"source {self.name!r}: {len(self.prompts)} prompts but {len(metadata)} metadata"
            )
        if not self.prompts:
            raise ValueError(f"source {self.name!r} has no prompts")
        object.__setattr__(self, "metadata", metadata)

    def __len__(self) -> int:
        return len(self.prompts)

    @functools.cached_property
    def digest(self) -> str:
        """A fingerprint of the prompts and metadata: a resumed run checks its text too."""
        text = json.dumps([self.prompts, self.metadata], sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


class SampledPrompt(NamedTuple):
    """One drawn prompt: unpacks as ``(prompt, source, metadata)``."""

    prompt: str
    source: str
    metadata: dict[str, Any]


def _read_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, stripped line) of the non-blank lines; errors name the file."""
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc})") from exc
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            yield number, line.strip()


def load_text_prompts(path: str | Path, name: str | None = None) -> PromptSource:
    """One prompt per line, blank lines skipped; ``name`` defaults to the file stem."""
    path = Path(path)
    prompts = tuple(line for _, line in _read_lines(path))
    if not prompts:
        raise ValueError(f"{path}: no prompts (the file is empty or blank)")
    return PromptSource(name or path.stem, prompts)


def load_geneval_metadata(path: str | Path, name: str | None = None) -> PromptSource:
    """GenEval metadata JSONL: each line an object with a string ``prompt``."""
    path = Path(path)
    prompts, metadata = [], []
    for number, line in _read_lines(path):
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: invalid JSON ({exc.msg})") from exc
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
            raise ValueError(f"{path}:{number}: expected a JSON object with a string 'prompt'")
        if not item["prompt"].strip():
            raise ValueError(f"{path}:{number}: empty 'prompt'")
        prompts.append(item["prompt"].strip())
        metadata.append(item)
    if not prompts:
        raise ValueError(f"{path}: no prompts (the file is empty or blank)")
    return PromptSource(name or path.stem, tuple(prompts), tuple(metadata))


def load_prompt_file(path: str | Path, name: str | None = None) -> PromptSource:
    """By extension: ``.jsonl`` is GenEval metadata, anything else plain text."""
    path = Path(path)
    if path.suffix == ".jsonl":
        return load_geneval_metadata(path, name)
    return load_text_prompts(path, name)


def find_prompt_file(root: str | Path, source: str, split: str) -> Path:
    """The file of ``source``/``split`` under ``root``, in either layout the data comes in.

    Tried in order: ``<source>/<split>.txt``, ``<source>/<split>_metadata.jsonl`` (the
    reference repos' ``dataset/`` folder), ``<source>_<split>.txt``,
    ``<source>_<split>_metadata.jsonl`` (flat copies).
    """
    root = Path(root)
    candidates = [
        root / source / f"{split}.txt",
        root / source / f"{split}_metadata.jsonl",
        root / f"{source}_{split}.txt",
        root / f"{source}_{split}_metadata.jsonl",
    ]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    tried = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(f"no {split!r} prompts for source {source!r}; tried {tried}")


def load_prompt_sources(
    root: str | Path, sources: Sequence[str], split: str = "train"
) -> list[PromptSource]:
    """One ``PromptSource`` per name in ``sources``, found under ``root``."""
    return [load_prompt_file(find_prompt_file(root, s, split), s) for s in sources]


class StratifiedPromptSampler:
    """Batches with a fixed share per source, without replacement within each source.

    Per-batch counts follow ``weights`` (default: equal) by carried-over quotas: each
    batch adds ``num_prompts * weight`` to a source's credit and hands out whole seats,
    leftover seats to the largest fractional credits. Every batch is within one prompt
    per source of its exact share and long-run shares are exact. Within a source the
    order is a fresh permutation per pass, a function of (seed, source, pass), and the
    batch is shuffled by (seed, batch index), so ``state_dict`` is a few counters and
    resuming reproduces the uninterrupted stream exactly.
    """

    def __init__(
        self, sources: Sequence[PromptSource], weights: Sequence[float] | None = None, seed: int = 0
    ):
        if not sources:
            raise ValueError("StratifiedPromptSampler needs at least one source")
        names = [s.name for s in sources]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate source names: {names}")
        weights = [1.0] * len(sources) if weights is None else [float(w) for w in weights]
        if len(weights) != len(sources):
            raise ValueError(f"{len(weights)} weights for {len(sources)} sources")
        if any(not np.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"weights must be finite, >= 0 and not all 0, got {weights}")
        self.sources = tuple(sources)
        self.weights = np.array(weights) / sum(weights)
        self.seed = seed
        self._credit = np.zeros(len(sources))
        self._cursor = [0] * len(sources)
        self._passes = [0] * len(sources)
        self._batches = 0

    def _counts(self, num_prompts: int) -> np.ndarray:
        self._credit += num_prompts * self.weights
        # A source handed a seat above its share carries negative credit: it gets no seat
        # (never a negative one) until its quota catches up.
        counts = np.floor(np.maximum(self._credit, 0.0)).astype(int)
        remainders = self._credit - counts
        # Stable sorts: ties go to the earlier source, deterministically.
        while counts.sum() > num_prompts:
            candidates = np.flatnonzero(counts > 0)
            counts[candidates[np.argmin(remainders[candidates])]] -= 1
            remainders = self._credit - counts
        leftover = num_prompts - counts.sum()
        counts[np.argsort(-remainders, kind="stable")[:leftover]] += 1
        self._credit -= counts
        return counts

    def _order(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, 0, index, self._passes[index]])
        return rng.permutation(len(self.sources[index]))

    def _draw(self, index: int, count: int) -> list[SampledPrompt]:
        source, drawn = self.sources[index], []
        while len(drawn) < count:
            order = self._order(index)
            take = order[self._cursor[index] : self._cursor[index] + count - len(drawn)]
            drawn += [
                SampledPrompt(
                    source.prompts[i], source.name, copy.deepcopy(dict(source.metadata[i]))
                )
                for i in take
            ]
            self._cursor[index] += len(take)
            if self._cursor[index] == len(source):
                self._cursor[index], self._passes[index] = 0, self._passes[index] + 1
        return drawn

    def sample(self, num_prompts: int) -> list[SampledPrompt]:
        """The next batch of ``num_prompts`` prompts, shuffled across sources."""
        if num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
        batch = []
        for index, count in enumerate(self._counts(num_prompts)):
            batch += self._draw(index, int(count))
        rng = np.random.default_rng([self.seed, 1, self._batches])
        self._batches += 1
        return [batch[i] for i in rng.permutation(len(batch))]

    def state_dict(self) -> dict[str, Any]:
        """Plain counters (JSON-safe); with the same sources and seed they resume exactly."""
        return {
            "seed": self.seed,
            "sources": [[s.name, len(s)] for s in self.sources],
            "digests": [s.digest for s in self.sources],
            "weights": self.weights.tolist(),
            "credit": self._credit.tolist(),
            "cursor": list(self._cursor),
            "passes": list(self._passes),
            "batches": self._batches,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()``; refuses a state taken over other sources or weights."""
        self.check_state(state)
        self._credit = np.array(state["credit"], dtype=float)
        self._cursor = [int(c) for c in state["cursor"]]
        self._passes = [int(p) for p in state["passes"]]
        self._batches = int(state["batches"])

    def edited_sources(self, state: Mapping[str, Any]) -> list[str]:
        """Sources whose text differs from when ``state`` was taken (same sizes, so the
        state still applies); none known for states saved without fingerprints."""
        saved = state.get("digests")
        if saved is None:
            return []
        return [s.name for s, d in zip(self.sources, saved, strict=True) if s.digest != d]

    def check_state(self, state: Mapping[str, Any]) -> None:
        """Raise ValueError unless ``state`` was taken over these sources, seed and weights."""
        mine = self.state_dict()
        sources = [[str(name), int(size)] for name, size in state["sources"]]
        if sources != mine["sources"]:
            raise ValueError(
                f"sampler state is over sources {sources}, this sampler over {mine['sources']}"
            )
        if state["seed"] != self.seed or not np.allclose(state["weights"], mine["weights"]):
            raise ValueError(
                f"sampler state has seed {state['seed']} and weights "
                f"{state['weights']}, this sampler {self.seed} and {mine['weights']}"
            )
