"""The device guard on the rewards and the evaluation: each scores on a logical GPU as on the CPU.

The trainer moves its rewards to its device (``RewardSet.to``) and hands them images on
that device (rollouts) or on the host (the evaluation decodes to the CPU). Every shipped
reward is built here from tiny offline weights, moved into ``logical_accelerator()``, and
scores host images and device images: both must come back on the CPU and equal the same
reward's CPU scores (exactly where the reward computes on the host anyway). The whole
evaluation (pipeline with a LoRA, rewards, scoring on a worker thread) then runs there
and must land where the CPU run lands.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from logical_accelerator import ACCELERATOR, AcceleratorTensor, DeviceMismatch, logical_accelerator
from torch import Tensor, nn

import miniature  # noqa: F401  (registers the miniature's rewards)
from miniature import world
from mogradient_diffusion.evaluation import evaluate
from mogradient_diffusion.evaluation.inputs import resolve_device
from mogradient_diffusion.model.policy import LoraSpec, Policy
from mogradient_diffusion.rewards import REWARDS, Reward, RewardSet, make_reward
from mogradient_diffusion.rewards.base import Metadata

from .reward_models import (
    save_tiny_aesthetic_head,
    save_tiny_clip,
    save_tiny_image_reward,
    save_tiny_mask2former,
)

Batch = tuple[Tensor, list[str], Metadata | None]
Weights = dict[str, Path]

# Shipped rewards without a case, each with the reason. None: every one builds offline.
EXCLUDED: dict[str, str] = {}
# Cases the guard cannot judge yet (it raises where a GPU does not), with the reason.
GUARD_GAPS: dict[str, str] = {}
# Where a model computes on the device, some kernels (attention) are chosen by device type
# and differ from the CPU's by round-off: measured at most 8e-7 relative (CLIP cosines).
FLOAT32 = {"rtol": 1e-5, "atol": 1e-6}
EXACT = {"rtol": 0.0, "atol": 0.0}
CLIP_PROMPTS = ["a photo of a cat", 'a red sign saying "hello"', "two blue dogs", "a dog"]
DETECTOR_LABELS = ("person", "dog", "cat", "traffic light")
GENEVAL_METADATA = [
    {"tag": "color_attr", "include": [{"class": "dog", "count": 1, "color": "red"}]},
    None,
    {"tag": "counting", "include": [{"class": "cat", "count": 2}]},
    {
        "tag": "position",
        "include": [
            {"class": "person", "count": 1},
            {"class": "dog", "count": 1, "color": "blue", "position": ["left of", 0]},
        ],
    },
]
# Keep every query the random detector proposes, so colors get classified too.
LOOSE_GENEVAL = {"threshold": 0.0, "counting_threshold": 0.0, "detector_size": 64}


def world_batch() -> Batch:
    """Clean renders of two prompts from each source of the mini world, with metadata:
    colors, counts, positions, quoted sign text, so every rule-based reward applies."""
    rng = random.Random(0)
    prompts = [p for source in world.all_prompts().values() for p in rng.sample(source, 2)]
    arrays = np.stack([np.asarray(world.render(world.sample_scene(p, rng))) for p in prompts])
    images = torch.from_numpy(arrays).permute(0, 3, 1, 2).float() / 255
    return images, [p.text for p in prompts], [p.metadata for p in prompts]


def random_images(count: int, height: int, width: int) -> Tensor:
    """Seeded noise images; not square, so the processors resize and crop."""
    return torch.rand(count, 3, height, width, generator=torch.Generator().manual_seed(0))


BATCHES: dict[str, Callable[[], Batch]] = {
    "world": world_batch,
    "clip": lambda: (random_images(len(CLIP_PROMPTS), 40, 48), CLIP_PROMPTS, None),
    "geneval": lambda: (random_images(4, 48, 56), ["p"] * 4, GENEVAL_METADATA),
}


def fixed_judge(image: np.ndarray, prompt: str) -> float:
    """UnifiedReward's judge without the server: a score of the uint8 image, in [0.2, 1]."""
    return 0.2 + 0.8 * float(image.mean()) / 255


def remote(weights: Weights) -> Reward:
    """The remote reward with its one request replaced (no server): only ``score``'s tensor
    handling and its pool of request threads run."""
    reward = make_reward("remote", url="http://127.0.0.1:9", batch_size=2)
    reward._request = lambda images, prompts, metadata, end: [  # type: ignore[method-assign]
        fixed_judge(image, prompt) for image, prompt in zip(images, prompts, strict=True)
    ]
    return reward


def unified_reward(weights: Weights) -> Reward:
    """The HTTP client with its request replaced: only ``score``'s tensor handling runs."""
    reward = make_reward("unified_reward", base_url="http://127.0.0.1:9/v1")
    reward.score_one = fixed_judge  # type: ignore[method-assign]
    return reward


@dataclass(frozen=True)
class Case:
    """How to build a reward, what to feed it, and whether it holds a model."""

    build: Callable[[Weights], Reward]
    batch: str = "world"
    model: bool = False
    reaches: str | None = None  # an attribute the reward builds while scoring this batch

    @property
    def tolerance(self) -> dict[str, float]:
        return FLOAT32 if self.model else EXACT


def plain(name: str, **options: Any) -> Case:
    """A rule-based reward scoring the mini world's renders on the host."""
    return Case(lambda weights: make_reward(name, **options))


def with_model(name: str, batch: str, **paths: str) -> Case:
    """A model-based reward whose options name (keys of ``weights``) its weight files."""

    def build(weights: Weights) -> Reward:
        return make_reward(name, **{option: weights[key] for option, key in paths.items()})

    return Case(build, batch, model=True)


def geneval(name: str) -> Case:
    """A GenEval reward keeping every detection, so it classifies colors with its CLIP."""

    def build(weights: Weights) -> Reward:
        paths = {"path": weights["mask2former"], "clip_path": weights["clip"]}
        return make_reward(name, **paths, **LOOSE_GENEVAL)

    return Case(build, "geneval", model=True, reaches="_clip")  # the color classifier


CASES: dict[str, Case] = {
    "aesthetic": with_model("aesthetic", "clip", path="clip", head="aesthetic_head"),
    "clip_score": with_model("clip_score", "clip", path="clip"),
    "color_match": plain("color_match"),
    "count_match": plain("count_match"),
    "geneval": geneval("geneval"),
    "geneval_strict": geneval("geneval_strict"),
    "hps_v21": with_model("hps_v21", "clip", path="clip"),
    "image_reward": with_model("image_reward", "clip", path="image_reward"),
    "jpeg_compressibility": plain("jpeg_compressibility"),
    "jpeg_incompressibility": plain("jpeg_incompressibility"),
    "mini_alignment": with_model("mini_alignment", "world"),
    "mini_amount": plain("mini_amount"),
    "mini_binding": plain("mini_binding"),
    "mini_binding_strict": plain("mini_binding_strict"),
    "mini_count": plain("mini_count"),
    "mini_count_strict": plain("mini_count_strict"),
    "mini_layout": plain("mini_layout"),
    "mini_noise": plain("mini_noise", like="mini_count"),  # stateful: a generator
    "mini_ocr": plain("mini_ocr"),
    "mini_ocr_strict": plain("mini_ocr_strict"),
    "mini_preference": with_model("mini_preference", "world"),
    "mini_preference_heldout": with_model("mini_preference_heldout", "world"),
    "mini_sign": plain("mini_sign"),
    "mini_style": plain("mini_style"),
    "ocr": plain("ocr"),
    "pick_score": with_model("pick_score", "clip", path="clip"),
    "remote": Case(remote),
    "unified_reward": Case(unified_reward),
}


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Weights:
    """Tiny random weights in the layouts the model-based rewards load."""
    root = tmp_path_factory.mktemp("reward_weights")
    return {
        "clip": save_tiny_clip(root / "clip"),
        "aesthetic_head": save_tiny_aesthetic_head(root / "aesthetic.safetensors"),
        "image_reward": save_tiny_image_reward(root / "image_reward"),
        "mask2former": save_tiny_mask2former(root / "mask2former", DETECTOR_LABELS),
    }


# Where the shipped rewards and their helper objects are defined.
PACKAGES = ("mogradient_diffusion.", "miniature.")


def held_tensors(reward: Reward) -> list[Tensor]:
    """Parameters, buffers and tensors a reward holds, also through the package's helper
    objects (a CLIP backbone, a wrapped reward) and through dicts and lists."""
    found: list[Tensor] = []
    todo: list[Any] = [reward]
    seen: set[int] = set()
    while todo:
        item = todo.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, nn.Module):
            found += [*item.parameters(), *item.buffers()]
        elif isinstance(item, Tensor):
            found.append(item)
        elif isinstance(item, dict):
            todo += item.values()
        elif isinstance(item, list | tuple):
            todo += item
        elif type(item).__module__.startswith(PACKAGES):
            todo += vars(item).values()
    return found


def assert_held_on(reward: Reward, device: torch.device, model: bool) -> None:
    """A model-based reward holds tensors, all on ``device``; a rule-based one holds none."""
    tensors = held_tensors(reward)
    assert bool(tensors) == model, f"{reward.name}: {len(tensors)} tensors held"
    assert all(t.device == device for t in tensors), {t.device for t in tensors}


def score_twice(reward: Reward, batch: Batch, device: torch.device | None = None) -> list[Tensor]:
    """Host images, then the same images on ``device`` (on the host without one): two
    calls on one reward, so a stateful reward advances alike on both sides."""
    images, prompts, metadata = batch
    moved = images if device is None else images.to(device)
    return [reward(images, prompts, metadata), reward(moved, prompts, metadata)]


def reward_params() -> list[Any]:
    """Every case; a guard gap must still raise (strict), so its mark goes once it does not."""
    gaps = {
        name: pytest.mark.xfail(raises=DeviceMismatch, strict=True, reason=why)
        for name, why in GUARD_GAPS.items()
    }
    return [pytest.param(name, marks=gaps.get(name, ())) for name in sorted(CASES)]


def test_every_shipped_reward_has_a_case() -> None:
    """A reward added later fails here until it gets a case (or a reasoned exclusion).

    Shipped: registered from the package's ``rewards`` and from ``miniature``; test
    helpers register others, which are not ours to guard.
    """
    shipped = {name for name, cls in REWARDS.items() if cls.__module__.startswith(PACKAGES)}
    assert set(CASES) == shipped - set(EXCLUDED)
    assert set(GUARD_GAPS) <= set(CASES)


@pytest.mark.parametrize("name", reward_params())
def test_reward_scores_on_the_accelerator_as_on_the_cpu(name: str, weights: Weights) -> None:
    """Moved to the device, the reward holds its models there and scores host and device
    images as its CPU twin does, returning the scores on the host."""
    case = CASES[name]
    batch = BATCHES[case.batch]()
    expected = score_twice(case.build(weights), batch)
    assert not expected[0].isnan().all(), "the batch leaves the reward nothing to score"
    with logical_accelerator() as device:
        reward = case.build(weights).to(device)
        assert_held_on(reward, device, case.model)
        scores = score_twice(reward, batch, device)
        assert case.reaches is None or getattr(reward, case.reaches) is not None
        assert_held_on(reward, device, case.model)  # models built while scoring too
    for got, want in zip(scores, expected, strict=True):
        assert type(got) is Tensor and got.device.type == "cpu"
        torch.testing.assert_close(got, want, equal_nan=True, **case.tolerance)


# --- the evaluation -----------------------------------------------------------------------

EVAL_METRICS = ["clip_score", "mini_preference", "jpeg_compressibility"]
# Measured: the guarded pipeline's images differ from the CPU's by up to 3.3e-6 (kernels
# chosen by device type, as above); the bound leaves a margin of about 10.
IMAGE_ATOL = 3e-5


@pytest.fixture(scope="module")
def lora_dir(tiny_pipeline_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA far from zero, so its layers change the images."""
    policy = Policy.load(tiny_pipeline_dir, LoraSpec(rank=4, alpha=8))
    generator = torch.Generator().manual_seed(0)
    for parameter in policy.trainable_parameters():
        parameter.data = torch.randn(parameter.shape, generator=generator) * 0.5
    return policy.save_lora(tmp_path_factory.mktemp("lora"))


def host_generator(seed: int, device: torch.device) -> torch.Generator:
    """The logical device has no generator; diffusers draws on a CPU one and moves the noise."""
    return torch.Generator().manual_seed(seed)


def accept_the_accelerator(name: str) -> torch.device:
    """``resolve_device`` accepting the logical device (it knows only real ones)."""
    return ACCELERATOR if name == str(ACCELERATOR) else resolve_device(name)


@dataclass
class Recorded:
    """What an evaluation generated, batch by batch, and on which device."""

    images: list[Tensor]
    devices: list[torch.device]


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[Recorded]:
    """``generate`` wrapped to record its images and device; ``generate_and_score`` to
    check that the rewards hold their models on the pipeline's device."""
    record = Recorded([], [])
    generate, generate_and_score = evaluate.generate, evaluate.generate_and_score

    def recording_generate(pipeline, samples, settings) -> Tensor:
        record.devices.append(pipeline.device)
        record.images.append(generate(pipeline, samples, settings))
        return record.images[-1]

    def recording_generate_and_score(pipeline, rewards: RewardSet, *args: Any) -> Any:
        for reward in rewards.rewards:
            assert_held_on(reward, pipeline.device, CASES[reward.name].model)
        return generate_and_score(pipeline, rewards, *args)

    monkeypatch.setattr(evaluate, "generate", recording_generate)
    monkeypatch.setattr(evaluate, "generate_and_score", recording_generate_and_score)
    yield record


def eval_settings(model: Path, lora: Path, clip: Path, out: Path) -> evaluate.EvalSettings:
    """Two prompts with GenEval metadata, two images each, in batches of 3 and 1, on the CPU."""
    return evaluate.EvalSettings(
        model=str(model),
        lora=str(lora),
        prompts="geneval",
        metrics=EVAL_METRICS,
        metric_options={"clip_score": {"path": str(clip)}},
        out=str(out),
        steps=2,
        max_prompts=2,
        images_per_prompt=2,
        batch_size=3,
        device="cpu",
        progress=False,
    )


def without_scores(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{key: value for key, value in row.items() if key not in EVAL_METRICS} for row in rows]


def read_rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def test_evaluation_runs_on_the_accelerator_as_on_the_cpu(
    tiny_pipeline_dir: Path,
    lora_dir: Path,
    weights: Weights,
    recorded: Recorded,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The images are the CPU run's (round-off); the scores are the CPU rewards' on the
    guarded run's own images (a pixel one rounding step off moves a uint8-based reward,
    so the CPU run's scores can differ by more than round-off)."""
    paths = (tiny_pipeline_dir, lora_dir, weights["clip"])
    evaluate.evaluate(eval_settings(*paths, tmp_path / "cpu"))
    cpu_images = torch.cat(recorded.images)
    recorded.images.clear()

    monkeypatch.setattr(evaluate, "resolve_device", accept_the_accelerator)
    monkeypatch.setattr(evaluate, "sample_generator", host_generator)
    settings = eval_settings(*paths, tmp_path / "lazy")
    with logical_accelerator() as device:
        evaluate.evaluate(replace(settings, device=str(device)))
    assert recorded.devices == [torch.device("cpu")] * 2 + [ACCELERATOR] * 2
    images = torch.cat(recorded.images)
    assert not isinstance(images, AcceleratorTensor)
    torch.testing.assert_close(images, cpu_images, rtol=0, atol=IMAGE_ATOL)

    rows = read_rows(tmp_path / "lazy")
    assert without_scores(rows) == without_scores(read_rows(tmp_path / "cpu"))
    options = settings.metric_options
    rewards = RewardSet([make_reward(name, **options.get(name, {})) for name in EVAL_METRICS])
    expected = rewards(images, [row["prompt"] for row in rows]).values
    got = torch.tensor([[row[name] for name in EVAL_METRICS] for row in rows])
    torch.testing.assert_close(got, expected, **FLOAT32)
