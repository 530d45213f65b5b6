"""The mini world's learned scorers: shipped checkpoints load, rank and align as trained.

Quality and alignment are measured on fresh renders (seed ``FRESH``, which the training
script never draws); the floors sit well below what the shipped checkpoints score, so
they catch a broken checkpoint or loader, not a slightly different retrain.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from miniature import scorers, train_scorers, world
from mogradient_diffusion.rewards import MissingWeightsError, make_reward

FRESH = 424_242
NAMES = ("mini_preference", "mini_preference_heldout", "mini_alignment")


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Small convs gain nothing from threads, and on a shared CPU two can stall for seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def fresh() -> dict:
    """48 fresh scenes: prompts, clean renders, and one heavy degradation each."""
    rng = random.Random(FRESH)
    gen = torch.Generator().manual_seed(FRESH)
    prompts = rng.choices(train_scorers.flat_prompts(), k=48)
    scenes = train_scorers.sample_scenes(prompts, rng)
    none = torch.zeros(len(scenes), len(train_scorers.DEGRADATIONS))
    heavy = train_scorers.heavy_severities(len(scenes), gen)
    return {
        "prompts": prompts,
        "scenes": scenes,
        "clean": train_scorers.make_images(scenes, none, rng, gen),
        "heavy": train_scorers.make_images(scenes, heavy, rng, gen),
    }


@pytest.fixture(scope="module")
def rewards() -> dict:
    return {name: make_reward(name) for name in NAMES}


def test_shipped_checkpoints_load_and_are_small(rewards: dict) -> None:
    total = 0
    for name, reward in rewards.items():
        assert reward.name == name
        total += (scorers.WEIGHTS_DIR / f"{name}.safetensors").stat().st_size
    assert rewards["mini_preference"].value_range == (0.0, 1.0)
    assert rewards["mini_alignment"].value_range == (-1.0, 1.0)
    assert total < 2_000_000
    report = json.loads((scorers.WEIGHTS_DIR / "training_report.json").read_text())
    assert set(report["scorers"]) == set(NAMES)


@pytest.mark.parametrize("name", ["mini_preference", "mini_preference_heldout"])
def test_quality_ranks_clean_above_heavily_degraded(name: str, rewards: dict, fresh: dict) -> None:
    # Measured 47/48 (mini_preference) and 48/48 (heldout); every degradation kind occurs.
    reward = rewards[name]
    texts = [p.text for p in fresh["prompts"]]
    clean, heavy = reward(fresh["clean"], texts), reward(fresh["heavy"], texts)
    assert clean.shape == heavy.shape == (48,)
    assert ((clean >= 0) & (clean <= 1)).all() and ((heavy >= 0) & (heavy <= 1)).all()
    assert (clean > heavy).float().mean() >= 0.85
    assert clean.mean() - heavy.mean() > 0.2


def test_quality_falls_with_severity(rewards: dict, fresh: dict) -> None:
    """Mean score over the fresh scenes drops as blur and noise grow."""
    reward = rewards["mini_preference"]
    texts = [p.text for p in fresh["prompts"]]
    rng, gen = random.Random(FRESH + 1), torch.Generator().manual_seed(FRESH + 1)
    means = []
    for level in (0.0, 0.5, 1.0):
        severities = torch.zeros(48, len(train_scorers.DEGRADATIONS))
        severities[:, train_scorers.DEGRADATIONS.index("blur")] = level
        severities[:, train_scorers.DEGRADATIONS.index("noise")] = level
        images = train_scorers.make_images(fresh["scenes"], severities, rng, gen)
        means.append(reward(images, texts).mean().item())
    assert means[0] > means[1] > means[2]


def test_alignment_prefers_the_matching_prompt(rewards: dict, fresh: dict) -> None:
    # Measured on these renders: the matching prompt wins all 112 comparisons.
    reward = rewards["mini_alignment"]
    rng = random.Random(FRESH)
    wins, total = 0, 0
    for image, prompt in zip(fresh["clean"], fresh["prompts"], strict=True):
        mismatches = train_scorers.mismatched_prompts(prompt, rng)
        kinds = (train_scorers.COLOR_KIND, "shape", "count", "word")
        wrong = [mismatches[k] for k in kinds if k in mismatches]
        scores = reward(image[None].expand(1 + len(wrong), -1, -1, -1), [prompt.text, *wrong])
        assert ((scores >= -1) & (scores <= 1)).all()
        wins += int((scores[0] > scores[1:]).sum())
        total += len(wrong)
    assert total > 60
    assert wins / total >= 0.8


def test_alignment_scores_shape_range_and_unknown_words(rewards: dict, fresh: dict) -> None:
    reward = rewards["mini_alignment"]
    texts = [p.text for p in fresh["prompts"]]
    scores = reward(fresh["clean"], texts)
    assert scores.shape == (48,) and scores.dtype == torch.float32
    assert ((scores >= -1) & (scores <= 1)).all()
    odd = reward(fresh["clean"][:2], ["a zebra on the moon", ""])
    assert torch.isfinite(odd).all()


def test_alignment_reads_the_word_on_a_sign(rewards: dict) -> None:
    """Among the 12 sign prompts, each sign's own word scores highest (measured 12/12)."""
    texts = [f'a sign that says "{word}"' for word in world.WORDS]
    images = torch.stack(
        [train_scorers.to_tensor(world.render(world.Scene(text=word))) for word in world.WORDS]
    )
    similarity = torch.stack([rewards["mini_alignment"](images, [t] * 12) for t in texts], 1)
    assert (similarity.argmax(1) == torch.arange(12)).float().mean() >= 0.75


@pytest.mark.parametrize("name", NAMES)
def test_batch_size_does_not_change_scores(name: str, rewards: dict, fresh: dict) -> None:
    texts = [p.text for p in fresh["prompts"]]
    whole = rewards[name](fresh["heavy"], texts)
    chunked = make_reward(name, batch_size=5)(fresh["heavy"], texts)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_any_resolution_is_resized_to_64(name: str, rewards: dict, fresh: dict) -> None:
    """A 128 px render scores about like the 64 px one (the reward resizes inside)."""
    scenes, texts = fresh["scenes"][:16], [p.text for p in fresh["prompts"][:16]]
    large = torch.stack([train_scorers.to_tensor(world.render(s, 128)) for s in scenes])
    small = rewards[name](fresh["clean"][:16], texts)
    resized = rewards[name](large, texts)
    assert resized.shape == (16,)
    assert (resized - small).abs().mean() < 0.1


def test_missing_weights_name_the_training_script(tmp_path: Path) -> None:
    with pytest.raises(MissingWeightsError, match="train_scorers"):
        make_reward("mini_preference", path=tmp_path)
    with pytest.raises(MissingWeightsError, match="train_scorers"):
        make_reward("mini_alignment", path=tmp_path / "absent")


def test_sampled_scenes_satisfy_their_prompt_and_not_their_mismatches() -> None:
    rng = random.Random(FRESH)
    for prompt in train_scorers.flat_prompts():
        scene = world.sample_scene(prompt, rng)
        assert train_scorers.satisfies(scene, prompt), prompt.text
        assert prompt.text not in train_scorers.mismatched_prompts(prompt, rng).values()


def test_training_script_runs_end_to_end_and_is_deterministic(tmp_path: Path) -> None:
    args = ["--steps", "2", "--eval-size", "16", "--eval-scenes", "1"]
    report = train_scorers.main(["--out", str(tmp_path / "a"), *args])
    train_scorers.main(["--out", str(tmp_path / "b"), *args])
    assert set(report["scorers"]) == set(NAMES)
    saved = json.loads((tmp_path / "a" / "training_report.json").read_text())
    assert saved["scorers"]["mini_alignment"]["metrics"]["n_images"] > 0
    images = torch.rand(3, 3, 64, 64)
    for name in NAMES:
        first = (tmp_path / "a" / f"{name}.safetensors").read_bytes()
        assert first == (tmp_path / "b" / f"{name}.safetensors").read_bytes()
        scores = make_reward(name, path=tmp_path / "a")(images, ["one red circle"] * 3)
        assert scores.shape == (3,) and torch.isfinite(scores).all()
