"""The dense color rewards on ``world`` renders and hand-built images.

Clean renders of scenes that satisfy their prompt score about 1; a scene without the
asked color scores 0; twice the asked objects halve the amount term; swapped positions
drop the relation term below one half; the centroid offset is checked against a
hand computation on two single-pixel masses.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from PIL import Image

from miniature import world
from miniature.color_rewards import (
    RELATION_SCALE,
    SIGMA,
    amount_match,
    color_weights,
    reference_area,
    relation_term,
)
from mogradient_diffusion.rewards import make_reward

COLOR_REWARDS = ("mini_amount", "mini_layout", "mini_style")
APPLIES = {
    "counting": {"mini_amount"},
    "color_attr": {"mini_layout"},
    "position": {"mini_layout"},
    "general": {"mini_amount", "mini_layout", "mini_style"},
    "text": set(),
}


def to_tensor(images: list[Image.Image]) -> torch.Tensor:
    arrays = np.stack([np.asarray(image, dtype=np.float32) for image in images])
    return torch.from_numpy(arrays).permute(0, 3, 1, 2) / 255


def score(name: str, images: list[Image.Image], prompts: list[world.MiniPrompt]) -> np.ndarray:
    reward = make_reward(name)
    return reward(to_tensor(images), [p.text for p in prompts], [p.metadata for p in prompts])


def clean_renders(per_source: int = 12, seed: int = 0) -> tuple[list, list]:
    rng = random.Random(seed)
    prompts = [p for source in world.all_prompts().values() for p in rng.sample(source, per_source)]
    return [world.render(world.sample_scene(p, rng)) for p in prompts], prompts


def test_clean_renders_score_about_one_where_the_reward_applies_and_nan_elsewhere():
    images, prompts = clean_renders()
    for name in COLOR_REWARDS:
        scores = score(name, images, prompts).numpy()
        for prompt, value in zip(prompts, scores, strict=True):
            if name in APPLIES[prompt.metadata["tag"]]:
                assert value > 0.8, (name, prompt.text, value)
            else:
                assert math.isnan(value), (name, prompt.text, value)
        applicable = scores[~np.isnan(scores)]
        assert applicable.mean() > 0.95, (name, applicable.mean())


def test_a_scene_without_the_asked_color_scores_zero_amount():
    counting = world.all_prompts()["counting"]
    prompt = next(p for p in counting if p.metadata["include"][0]["count"] == 2)
    blank = world.render(world.Scene())
    assert score("mini_amount", [blank], [prompt]).item() == pytest.approx(0.0, abs=1e-6)


def test_twice_the_asked_objects_halve_the_amount():
    rng = random.Random(3)
    one = next(p for p in world.all_prompts()["counting"] if p.metadata["include"][0]["count"] == 1)
    entry = {**one.metadata["include"][0], "count": 2}
    two = world.MiniPrompt("", "counting", {"tag": "counting", "include": [entry]})
    scene = world.sample_scene(two, rng)  # two objects of the size the world draws for 2
    area = color_weights(np.asarray(world.render(scene)), entry["color"]).sum()
    _, high = reference_area(entry["class"], 1)
    got = score("mini_amount", [world.render(scene)], [one]).item()
    assert got == pytest.approx(min(1.0, high / area), rel=1e-5)
    assert got < 0.8  # two objects where one was asked


def test_amount_match_is_one_inside_the_range_and_the_ratio_to_the_nearer_end_outside():
    assert amount_match(0.0, 10.0, 20.0) == 0.0
    assert amount_match(15.0, 10.0, 20.0) == 1.0
    assert amount_match(5.0, 10.0, 20.0) == pytest.approx(0.5)
    assert amount_match(40.0, 10.0, 20.0) == pytest.approx(0.5)


def test_swapped_positions_drop_the_relation_term():
    prompt = next(p for p in world.all_prompts()["binding"] if p.metadata["tag"] == "position")
    target, mover = prompt.metadata["include"]
    opposite = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
    relation = mover["position"][0]
    swapped_meta = {
        "tag": "position",
        "include": [target, {**mover, "position": [opposite[relation], 0]}],
    }
    swapped = world.MiniPrompt(prompt.text, "binding", swapped_meta)
    rng = random.Random(1)
    right = [world.render(world.sample_scene(prompt, rng)) for _ in range(6)]
    wrong = [world.render(world.sample_scene(swapped, rng)) for _ in range(6)]
    on_right = score("mini_layout", right, [prompt] * 6).numpy()
    on_wrong = score("mini_layout", wrong, [prompt] * 6).numpy()
    # the presence terms hold in both; the relation term flips from ~1 to ~0
    assert on_right.min() > 0.8
    assert on_wrong.max() < 0.7
    assert (on_right - on_wrong).min() > 0.25


def test_relation_term_is_the_logistic_of_the_centroid_offset():
    a, b = np.zeros((64, 64)), np.zeros((64, 64))
    a[30, 10] = 1.0  # row 30, column 10
    b[20, 18] = 1.0  # row 20, column 18: a is 8 px left of b and 10 px below it
    logistic = lambda x: 1 / (1 + math.exp(-x / RELATION_SCALE))  # noqa: E731
    assert relation_term(a, b, "left of") == pytest.approx(logistic(8))
    assert relation_term(a, b, "right of") == pytest.approx(logistic(-8))
    assert relation_term(a, b, "below") == pytest.approx(logistic(10))
    assert relation_term(a, b, "above") == pytest.approx(logistic(-10))
    assert relation_term(a, np.zeros_like(b), "left of") == 0.0


def test_style_reads_the_backdrop_color():
    prompt = next(p for p in world.all_prompts()["general"] if p.metadata["style"] == "night")
    night = world.render(world.Scene(background=world.STYLES["night"]))
    beach = world.render(world.Scene(background=world.STYLES["beach"]))
    scores = score("mini_style", [night, beach], [prompt, prompt]).numpy()
    assert scores[0] == pytest.approx(1.0)
    beach, night = world.STYLES["beach"], world.STYLES["night"]
    distance2 = sum((x - y) ** 2 for x, y in zip(beach, night, strict=True))
    assert scores[1] == pytest.approx(math.exp(-distance2 / (2 * SIGMA**2)), rel=1e-4)


def test_color_weights_are_one_on_the_palette_color_and_fall_with_distance():
    """And zero on the backdrop, whatever color it is."""
    image = np.full((8, 8, 3), 255, dtype=np.uint8)  # a white backdrop
    image[3, 3] = world.COLORS["red"]
    red, green, blue = world.COLORS["red"]
    image[3, 4] = (red, green + SIGMA, blue)
    weights = color_weights(image, "red")
    off_white = 1 - math.exp(-sum((255 - int(c)) ** 2 for c in image[3, 3]) / (2 * SIGMA**2))
    assert weights[3, 3] == pytest.approx(off_white, rel=1e-5)
    assert off_white > 0.999
    assert weights[3, 4] == pytest.approx(math.exp(-0.5), rel=1e-3)
    assert weights[0, 0] == 0.0  # the backdrop itself


def test_bad_sigma_is_refused():
    with pytest.raises(ValueError, match="sigma must be positive"):
        make_reward("mini_amount", sigma=0)
