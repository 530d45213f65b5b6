"""The miniature's shared recipe: the shipped base model, the training config, the rewards
it trains on and the metrics it holds out, and the prompt files it reads.

One home for what the experiments (``benchmarks/mini``) and the engine-cost benchmark all
build on, so none of them defines the world's training setup twice. ``TRAIN_REWARDS`` is
read from ``config.yaml``: the recipe's reward list is its single source.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import yaml

from miniature.world import MiniPrompt, split_prompts

HERE = Path(__file__).parent
BASE_MODEL = HERE / "base_model"
CONFIG = HERE / "config.yaml"
# The training rewards, one per axis of the paper's mix: quality (PickScore), prompt
# following (CLIPScore), text (OCR), counting and binding (GenEval). The dense color
# rewards replaced mini_alignment, mini_count and mini_binding, which their own
# specialists did not learn in this budget (learnability.md); those stay as held-out
# metrics beside the strict ones.
TRAIN_REWARDS: tuple[str, ...] = tuple(
    reward["name"] for reward in yaml.safe_load(CONFIG.read_text())["rewards"]
)
HELD_OUT = (
    "mini_preference_heldout",
    "mini_alignment",
    "mini_ocr",
    "mini_count",
    "mini_binding",
    "mini_count_strict",
    "mini_binding_strict",
    "mini_ocr_strict",
)


def write_prompt_files(directory: Path) -> Path:
    """Training prompts per source (JSONL with metadata) and the held-out evaluation file."""
    directory.mkdir(parents=True, exist_ok=True)
    train, held_out = split_prompts(seed=0)
    for source, prompts in train.items():
        _write_jsonl(directory / f"{source}.jsonl", prompts)
    _write_jsonl(directory / "heldout.jsonl", _interleave(list(held_out.values())))
    return directory


def _interleave(groups: list[list[MiniPrompt]]) -> list[MiniPrompt]:
    """Round-robin over sources, so any prefix of the file mixes them."""
    mixed, index = [], 0
    while any(index < len(g) for g in groups):
        mixed += [g[index] for g in groups if index < len(g)]
        index += 1
    return mixed


def _write_jsonl(path: Path, prompts: list[MiniPrompt]) -> None:
    """Write atomically: concurrent checks rewrite the same files while others read them."""
    text = "".join(json.dumps({"prompt": p.text, **p.metadata}) + "\n" for p in prompts)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
        tmp.write(text)
    os.replace(tmp.name, path)
