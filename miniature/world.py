"""The miniature world: flat scenes of colored shapes, signs with words, styled backdrops.

Four prompt sources mirror the paper's mixed prompt set: ``general`` (a styled scene
with one object, the PickScore-prompt analogue), ``text`` (a sign showing a quoted
word, the OCR analogue) and the GenEval analogue with GenEval-format metadata, split in
``counting`` and ``binding`` (color binding, spatial relations) so that with equal
source weights each specialist reward gets a quarter of every batch rather than a
sixth. Every prompt comes with
a sampler of scenes that satisfy it, which gives the training data of the base model
and of the learned scorers; rendering is plain PIL at 64 px.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from PIL import Image, ImageDraw, ImageFont

SIZE = 64
SHAPES = ("circle", "square", "triangle")
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 160, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 30),
    "purple": (140, 60, 190),
}
PLAIN_BACKGROUND = (245, 245, 245)
STYLES: dict[str, tuple[int, int, int]] = {
    "sunny": (150, 200, 250),
    "night": (25, 30, 60),
    "beach": (240, 220, 170),
    "garden": (170, 215, 150),
}
WORDS = ("CAT", "DOG", "SUN", "BUS", "MAP", "HAT", "TOP", "BOX", "CUP", "KEY", "FOX", "JAM")
NUMBERS = ("one", "two", "three", "four")
RELATIONS = ("left of", "right of", "above", "below")
SIGN_COLOR = (255, 255, 255)
INK = (10, 10, 10)


@dataclass(frozen=True)
class Shape:
    shape: str
    color: str
    x: float  # centre, pixels
    y: float
    size: float  # side / diameter, pixels


@dataclass
class Scene:
    background: tuple[int, int, int] = PLAIN_BACKGROUND
    shapes: list[Shape] = field(default_factory=list)
    text: str | None = None


@dataclass(frozen=True)
class MiniPrompt:
    """A prompt, its source, and the metadata rewards score against (GenEval format)."""

    text: str
    source: str
    metadata: dict[str, Any]


def render(scene: Scene, size: int = SIZE) -> Image.Image:
    """Draw ``scene`` at ``size`` px (coordinates are in 64 px units, scaled)."""
    scale = size / SIZE
    image = Image.new("RGB", (size, size), scene.background)
    draw = ImageDraw.Draw(image)
    if scene.text is not None:
        _draw_sign(draw, scene.text, scale)
    for item in scene.shapes:
        _draw_shape(draw, item, scale)
    return image


def _draw_shape(draw: ImageDraw.ImageDraw, item: Shape, scale: float) -> None:
    half = item.size * scale / 2
    x, y = item.x * scale, item.y * scale
    fill = COLORS[item.color]
    if item.shape == "circle":
        draw.ellipse((x - half, y - half, x + half, y + half), fill=fill)
    elif item.shape == "square":
        draw.rectangle((x - half, y - half, x + half, y + half), fill=fill)
    else:
        draw.polygon([(x, y - half), (x + half, y + half), (x - half, y + half)], fill=fill)


def _draw_sign(draw: ImageDraw.ImageDraw, word: str, scale: float) -> None:
    draw.rectangle((4 * scale, 16 * scale, 60 * scale, 48 * scale), fill=SIGN_COLOR)
    font = ImageFont.load_default(size=max(8, round(20 * scale)))
    draw.text((32 * scale, 32 * scale), word, fill=INK, font=font, anchor="mm")


# --- prompts ------------------------------------------------------------------------------


def general_prompts() -> list[MiniPrompt]:
    """A styled backdrop with one colored shape: 4 styles x 5 colors x 3 shapes."""
    return [
        MiniPrompt(
            f"a {style} scene with a {color} {shape}",
            "general",
            {"tag": "general", "style": style, "include": [_entry(shape, 1, color)]},
        )
        for style in STYLES
        for color in COLORS
        for shape in SHAPES
    ]


def text_prompts() -> list[MiniPrompt]:
    """A sign showing a word in double quotes (the OCR reward's target)."""
    return [
        MiniPrompt(f'a sign that says "{word}"', "text", {"tag": "text", "text": word})
        for word in WORDS
    ]


def compositional_prompts() -> list[MiniPrompt]:
    """Counting, color binding and spatial relations, GenEval-style metadata."""
    prompts = []
    for count, number in enumerate(NUMBERS, start=1):
        for color in COLORS:
            for shape in SHAPES:
                noun = shape if count == 1 else shape + "s"
                prompts.append(
                    MiniPrompt(
                        f"{number} {color} {noun}",
                        "counting",
                        {"tag": "counting", "include": [_entry(shape, count, color)]},
                    )
                )
    pairs = [(a, b) for a in SHAPES for b in SHAPES if a != b]
    color_names = list(COLORS)
    for i, (a, b) in enumerate(pairs):
        for j, ca in enumerate(color_names):
            cb = color_names[(j + 1 + i % 4) % len(color_names)]  # never color a
            prompts.append(
                MiniPrompt(
                    f"a {ca} {a} and a {cb} {b}",
                    "binding",
                    {"tag": "color_attr", "include": [_entry(a, 1, ca), _entry(b, 1, cb)]},
                )
            )
            relation = RELATIONS[(i + j) % len(RELATIONS)]
            prompts.append(
                MiniPrompt(
                    f"a {ca} {a} {relation} a {cb} {b}",
                    "binding",
                    {
                        "tag": "position",
                        "include": [
                            _entry(b, 1, cb),
                            {**_entry(a, 1, ca), "position": [relation, 0]},
                        ],
                    },
                )
            )
    return prompts


def all_prompts() -> dict[str, list[MiniPrompt]]:
    """Prompts by source (the training sources of the shared recipe)."""
    compositional = compositional_prompts()
    return {
        "general": general_prompts(),
        "text": text_prompts(),
        "counting": [p for p in compositional if p.source == "counting"],
        "binding": [p for p in compositional if p.source == "binding"],
    }


def split_prompts(seed: int = 0, eval_share: float = 0.25) -> tuple[dict, dict]:
    """Per source, a fixed train / held-out evaluation split of the prompts."""
    train, held_out = {}, {}
    for source, prompts in all_prompts().items():
        order = list(prompts)
        random.Random(seed).shuffle(order)
        cut = max(1, round(len(order) * eval_share))
        held_out[source], train[source] = order[:cut], order[cut:]
    return train, held_out


def vocabulary() -> tuple[str, ...]:
    """Every word the prompts use (for the tiny pipeline's tokenizers)."""
    words = {
        word.strip('"').lower()
        for prompts in all_prompts().values()
        for prompt in prompts
        for word in prompt.text.split()
    }
    return tuple(sorted(words))


def _entry(shape: str, count: int, color: str) -> dict[str, Any]:
    return {"class": shape, "count": count, "color": color}


# --- scenes that satisfy a prompt ---------------------------------------------------------


def sample_scene(prompt: MiniPrompt, rng: random.Random) -> Scene:
    """A random scene the prompt describes correctly (positions, sizes drawn by ``rng``)."""
    meta = prompt.metadata
    if meta["tag"] == "text":
        return Scene(text=meta["text"])
    background = STYLES[meta["style"]] if meta["tag"] == "general" else PLAIN_BACKGROUND
    for _ in range(200):
        shapes = _place(meta["include"], rng)
        if shapes is not None:
            return Scene(background=background, shapes=shapes)
    raise RuntimeError(f"could not place the shapes of {prompt.text!r}")


def _place(include: list[dict[str, Any]], rng: random.Random) -> list[Shape] | None:
    groups: list[list[Shape]] = []
    placed: list[Shape] = []
    for entry in include:
        group = []
        for _ in range(entry["count"]):
            size = rng.uniform(12, 17) if entry["count"] <= 2 else rng.uniform(10, 13)
            item = Shape(
                entry["class"], entry["color"], rng.uniform(9, 55), rng.uniform(9, 55), size
            )
            if any(_overlaps(item, other) for other in placed):
                return None
            group.append(item)
            placed.append(item)
        if "position" in entry:
            relation, target = entry["position"]
            if not all(_holds(a, b, relation) for a in group for b in groups[target]):
                return None
        groups.append(group)
    return placed


def _overlaps(a: Shape, b: Shape, gap: float = 3.0) -> bool:
    reach = (a.size + b.size) / 2 + gap
    return abs(a.x - b.x) < reach and abs(a.y - b.y) < reach


def _holds(a: Shape, b: Shape, relation: str) -> bool:
    """A clear-cut relation: mostly along one axis, so rule checks agree with a reader."""
    dx, dy = a.x - b.x, a.y - b.y
    distance = math.hypot(dx, dy)
    if distance < (a.size + b.size) / 2 + 4:
        return False
    return {
        "left of": dx < -0.7 * distance,
        "right of": dx > 0.7 * distance,
        "above": dy < -0.7 * distance,
        "below": dy > 0.7 * distance,
    }[relation]
