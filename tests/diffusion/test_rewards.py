"""Rewards: the validated interface, registry, RewardSet, OCR on rendered text, JPEG, color
and count checks on synthetic images."""

from __future__ import annotations

import io
import math
import random
import shutil

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from mogradient.registry import Registry
from mogradient_diffusion.rewards import (
    REWARDS,
    ColorMatch,
    CountMatch,
    HpsV21,
    PickScore,
    Reward,
    RewardError,
    RewardSet,
    classify_pixels,
    colors_in_prompt,
    count_in_prompt,
    count_objects,
    levenshtein,
    make_reward,
    normalize_text,
    quoted_text,
    register_reward,
    text_match_score,
)
from mogradient_diffusion.rewards import registry as registry_module
from mogradient_diffusion.rewards.background import BackgroundScoring
from mogradient_diffusion.rewards.color import COLORS


def to_tensor(image: Image.Image | np.ndarray) -> torch.Tensor:
    """[3, H, W] float in [0, 1] from a PIL image or an [H, W, 3] uint8 array."""
    array = np.array(image, dtype=np.uint8)
    return torch.from_numpy(array).permute(2, 0, 1).float() / 255


def solid(color: tuple[int, int, int], size: int = 32) -> np.ndarray:
    return np.full((size, size, 3), color, dtype=np.uint8)


# --- interface, registry, RewardSet -------------------------------------------------------


class Constant(Reward):
    """Test reward: a fixed value (or a callable of the chunk), recording chunk sizes."""

    name = "constant"
    value_range = (0.0, 1.0)

    def __init__(self, value=0.5, name: str = "constant", batch_size: int | None = None):
        super().__init__(batch_size=batch_size)
        self.name = name
        self.value = value
        self.chunks: list[int] = []
        self.metadata = None

    def score(self, images, prompts, metadata):
        self.chunks.append(len(prompts))
        self.metadata = metadata
        if callable(self.value):
            return self.value(images, prompts)
        return torch.full((len(prompts),), self.value)


def test_batching_keeps_order_and_metadata_passes_through():
    reward = Constant(lambda images, prompts: images[:, 0, 0, 0], batch_size=2)
    images = torch.linspace(0, 1, 5).view(5, 1, 1, 1).expand(5, 3, 4, 4)
    metadata = [{"i": i} for i in range(5)]
    out = reward(images, ["p"] * 5, metadata)
    assert reward.chunks == [2, 2, 1]
    assert reward.metadata == [{"i": 4}]
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.linspace(0, 1, 5))


@pytest.mark.parametrize(
    ("images", "prompts", "match"),
    [
        (torch.rand(2, 3, 8, 8) * 2 - 1, ["a", "b"], r"\[0, 1\]"),
        (torch.rand(2, 3, 8, 8), ["a"], "2 images but 1 prompts"),
        (torch.rand(3, 8, 8), ["a"], r"\[B, 3, H, W\]"),
        (torch.rand(2, 4, 8, 8), ["a", "b"], r"\[B, 3, H, W\]"),
        (torch.zeros(2, 3, 8, 8, dtype=torch.uint8), ["a", "b"], "floating point"),
    ],
)
def test_input_validation_names_the_reward(images, prompts, match):
    with pytest.raises(ValueError, match=match) as info:
        Constant()(images, prompts)
    assert "constant" in str(info.value)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (lambda images, prompts: torch.full((len(prompts),), 1.5), "outside the declared range"),
        (lambda images, prompts: torch.full((len(prompts),), math.inf), "outside"),
        (lambda images, prompts: torch.zeros(len(prompts), 2), "shape"),
    ],
)
def test_invalid_scores_raise_naming_the_reward(value, match):
    with pytest.raises(RewardError, match=match) as info:
        Constant(value)(torch.rand(2, 3, 4, 4), ["a", "b"])
    assert "constant" in str(info.value)


def test_nan_is_allowed_and_kept():
    out = Constant(math.nan)(torch.rand(2, 3, 4, 4), ["a", "b"])
    assert torch.isnan(out).all()


def test_reward_set_matrix_timings_and_failures():
    images = torch.rand(3, 3, 8, 8)
    rewards = RewardSet([Constant(0.25, "a"), Constant(math.nan, "b"), Constant(1.0, "c")])
    values, seconds = rewards(images, ["x", "y", "z"])
    assert values.shape == (3, 3) and rewards.names == ("a", "b", "c")
    assert set(seconds) == {"a", "b", "c"} and min(seconds.values()) >= 0
    torch.testing.assert_close(values[:, 0], torch.full((3,), 0.25))
    assert torch.isnan(values[:, 1]).all()
    torch.testing.assert_close(values[:, 2], torch.ones(3))

    def boom(images, prompts):
        raise OSError("disk on fire")

    with pytest.raises(RewardError, match="reward 'bad' failed: disk on fire") as info:
        RewardSet([Constant(0.5, "ok"), Constant(boom, "bad")])(images, ["x"] * 3)
    assert isinstance(info.value.__cause__, OSError)
    with pytest.raises(RewardError, match="reward 'ok' failed"):
        RewardSet([Constant(0.5, "ok")])(images * 3, ["x"] * 3)
    with pytest.raises(ValueError, match="duplicate reward names"):
        RewardSet([Constant(name="a"), Constant(name="a")])


def test_registry(monkeypatch):
    assert {"ocr", "jpeg_compressibility", "jpeg_incompressibility", "color_match"} <= set(REWARDS)
    assert isinstance(make_reward("color_match", min_share=0.1), ColorMatch)
    with pytest.raises(KeyError, match=r"unknown reward 'nope'.*color_match"):
        make_reward("nope")
    with pytest.raises(KeyError, match=r"did you mean 'color_match'"):
        make_reward("colr_match")
    with pytest.raises(TypeError, match="reward 'color_match': bad options"):
        make_reward("color_match", color=1)

    fresh = Registry("reward")
    for name, cls in REWARDS.items():
        fresh.add(name, cls, cls.aliases)
    monkeypatch.setattr(registry_module, "REWARDS", fresh)

    @register_reward
    class Mine(Constant):
        name = "mine"
        aliases = ("my_old_name",)

    assert isinstance(registry_module.make_reward("mine"), Mine)
    with pytest.raises(ValueError, match="already taken"):

        @register_reward
        class Other(Constant):
            name = "mine"

    with pytest.raises(ValueError, match="not lower snake case"):

        @register_reward
        class Camel(Constant):
            name = "MyReward"


def test_old_spellings_name_the_same_reward_and_stay_its_name(monkeypatch):
    """A run configured with ``pickscore`` builds PickScore and keys its metrics
    ``pickscore``: the reward keeps the name the config wrote."""
    renamed = {"pickscore": "pick_score", "clipscore": "clip_score", "hpsv21": "hps_v21"}
    assert {old: REWARDS.canonical(old) for old in renamed} == renamed
    assert REWARDS["pickscore"] is PickScore and REWARDS["hpsv21"] is HpsV21
    assert "pickscore" not in list(REWARDS)  # iteration: each reward once, by its name

    fresh = Registry("reward")
    monkeypatch.setattr(registry_module, "REWARDS", fresh)

    @register_reward
    class Renamed(Constant):
        name = "new_name"
        aliases = ("newname",)

    old, new = registry_module.make_reward("newname"), registry_module.make_reward("new_name")
    assert isinstance(old, Renamed) and (old.name, new.name) == ("newname", "new_name")
    assert RewardSet([old]).names == ("newname",)


# --- OCR ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b", "distance"),
    [
        ("kitten", "sitting", 3),
        ("flaw", "lawn", 2),
        ("intention", "execution", 5),
        ("abc", "acb", 2),  # no transpositions
        ("", "abc", 3),
        ("abc", "", 3),
        ("same", "same", 0),
        ("hello", "helo", 1),
    ],
)
def test_levenshtein_hand_values(a, b, distance):
    assert levenshtein(a, b) == distance == levenshtein(b, a)


def test_quoted_text_and_normalization():
    assert quoted_text('A sign that says "Hello World" at dusk') == "Hello World"
    assert quoted_text('"first" and "second"') == "first"
    assert quoted_text("no quotes at all") is None
    assert quoted_text("single 'quotes' do not count") is None
    assert quoted_text('an unclosed " quote') is None
    assert quoted_text('empty "" and blank "  "') is None
    assert normalize_text(" Hello \n  WORLD\t") == "helloworld"


def test_text_match_score():
    assert text_match_score("HELLO world", "hello World") == 1.0
    assert text_match_score("hello wurld", "Hello World") == pytest.approx(0.9)
    assert text_match_score("", "Hello") == 0.0
    assert text_match_score("Caf Hello World Open", "Hello World") == 1.0
    assert text_match_score("ab", "abcd", substring_match=False) == 0.5
    assert text_match_score("xx hello", "hello", substring_match=False) == pytest.approx(0.6)
    # Long garbage takes a shortcut; it must agree with the full formula.
    rng = random.Random(0)
    for _ in range(200):
        target = "".join(rng.choices("abc", k=rng.randint(1, 6)))
        read = "".join(rng.choices("abcd", k=rng.randint(0, 14)))
        expected = max(0.0, 1 - levenshtein(read, target) / len(target))
        got = text_match_score(read, target, substring_match=False)
        assert got == pytest.approx(expected)


needs_tesseract = pytest.mark.skipif(
    shutil.which("tesseract") is None, reason="the tesseract binary is not installed"
)


def render_text(text: str, size: tuple[int, int] = (256, 64)) -> torch.Tensor:
    """Black text on white; Pillow's bundled scalable font (needs Pillow with FreeType)."""
    font = ImageFont.load_default(size=size[1] * 5 // 8)
    if not isinstance(font, ImageFont.FreeTypeFont):
        pytest.skip("Pillow without FreeType cannot render large text")
    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).text((size[1] // 8, size[1] // 8), text, fill="black", font=font)
    return to_tensor(image)


@needs_tesseract
def test_ocr_reward_on_rendered_text():
    pytest.importorskip("pytesseract")
    hello = render_text("Hello World")
    blank = torch.ones(3, 64, 256)
    images = torch.stack([hello, hello, hello, hello, hello, blank])
    prompts = [
        'A sign that says "Hello World".',
        'A sign that says "Hello Wurld".',  # one substitution in 10 characters
        "A sign that says Hello World.",  # no quoted text: not applicable
        'Big letters: "hello  WORLD"',  # case and spaces are ignored
        'Only part: "World"',  # contained in what was read
        'A blank page with "Hello"',
    ]
    ocr = make_reward("ocr")
    scores = ocr(images, prompts)
    expected = torch.tensor([1.0, 0.9, math.nan, 1.0, 1.0, 0.0])
    torch.testing.assert_close(scores, expected, equal_nan=True)
    small = torch.nn.functional.interpolate(hello[None], size=(16, 64), mode="area")
    assert ocr(small, ['A tiny sign "Hello World"']).item() == 1.0  # upscaled before reading
    strict = make_reward("ocr", substring_match=False, psm=7)
    assert strict(hello[None], ['"World"']).item() == 0.0  # "helloworld" vs "world": 5 edits


@needs_tesseract
def test_ocr_errors(monkeypatch):
    pytesseract = pytest.importorskip("pytesseract")
    before = pytesseract.pytesseract.tesseract_cmd
    with pytest.raises(RuntimeError, match="apt-get install tesseract-ocr"):
        make_reward("ocr", tesseract_cmd="/nonexistent/tesseract")
    assert pytesseract.pytesseract.tesseract_cmd == before
    with pytest.raises(ValueError, match="tesseract-ocr-xyz"):
        make_reward("ocr", lang="xyz")
    with pytest.raises(ValueError, match="psm"):
        make_reward("ocr", psm=42)


# --- JPEG -----------------------------------------------------------------------------------


def test_jpeg_sizes_match_pillow_and_order_images():
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    flat = solid((120, 30, 200), 64)
    images = torch.stack([to_tensor(noise), to_tensor(flat)])
    incompressibility = make_reward("jpeg_incompressibility")(images, ["a", "b"])
    compressibility = make_reward("jpeg_compressibility")(images, ["a", "b"])
    buffer = io.BytesIO()
    Image.fromarray(noise).save(buffer, format="JPEG", quality=95)
    assert incompressibility[0].item() == pytest.approx(buffer.tell() / 1000)
    assert incompressibility[0] > 5 * incompressibility[1] > 0
    torch.testing.assert_close(compressibility, -incompressibility)
    with pytest.raises(ValueError, match="quality"):
        make_reward("jpeg_compressibility", quality=0)


# --- color and count ---------------------------------------------------------------------


PALETTE = {
    "red": [(255, 0, 0), (200, 30, 30), (128, 0, 0)],
    "orange": [(255, 165, 0), (255, 140, 0)],
    "yellow": [(255, 255, 0), (255, 215, 0)],
    "green": [(0, 128, 0), (0, 255, 0), (34, 139, 34)],
    "blue": [(0, 0, 255), (30, 60, 200), (0, 0, 128), (0, 255, 255), (135, 206, 235)],
    "purple": [(128, 0, 128), (75, 0, 130), (147, 112, 219)],
    "pink": [(255, 192, 203), (255, 105, 180), (255, 20, 147)],
    "brown": [(139, 69, 19), (160, 82, 45), (210, 180, 140)],
    "black": [(0, 0, 0), (20, 20, 20), (10, 10, 40)],
    "white": [(255, 255, 255), (245, 245, 245), (250, 240, 230)],
    "gray": [(128, 128, 128), (90, 90, 90), (192, 192, 192)],
}


@pytest.mark.parametrize("name", list(PALETTE))
def test_pixel_classes(name):
    labels = classify_pixels(np.array(PALETTE[name], dtype=np.uint8))
    assert [COLORS[i] for i in labels] == [name] * len(PALETTE[name])


def test_colors_in_prompt():
    assert colors_in_prompt("A Grey cat, a RED ball and a grey hat") == ["gray", "red"]
    assert colors_in_prompt("a redwood forest, reddish sky, whitewash") == []


def test_color_match_on_synthetic_images():
    red_blue = solid((220, 20, 20))
    red_blue[:, 16:] = (20, 40, 220)
    speck = solid((255, 255, 255))
    speck[:2, :2] = (0, 160, 0)  # 4 of 1024 pixels: below the 3% share
    images = torch.stack([to_tensor(red_blue)] * 3 + [to_tensor(speck)] * 2)
    prompts = [
        "a red ball and a blue cube",
        "a red ball and a green cube",
        "a ball and a cube",
        "a green dot on white",
        "a green dot",
    ]
    scores = ColorMatch()(images, prompts)
    torch.testing.assert_close(scores, torch.tensor([1.0, 0.5, math.nan, 0.5, 0.0]), equal_nan=True)
    assert ColorMatch(min_share=0.003)(images[4:], ["a green dot"]).item() == 1.0

    # graded: the share over the threshold, capped at 1; a green speck of 4/1024 pixels
    # against min_share 0.03 scores (4 / 1024) / 0.03 = 0.130
    graded = ColorMatch(graded=True)(images, prompts)
    expected = [1.0, 0.5, math.nan, (1.0 + 4 / 1024 / 0.03) / 2, 4 / 1024 / 0.03]
    torch.testing.assert_close(graded, torch.tensor(expected), equal_nan=True)
    with pytest.raises(ValueError, match="graded must be true or false"):
        ColorMatch(graded="yes")


def disks(centres: list[tuple[int, int]], size: int = 64, radius: int = 6) -> np.ndarray:
    image = Image.new("RGB", (size, size), (250, 250, 245))
    draw = ImageDraw.Draw(image)
    for x, y in centres:
        draw.ellipse((x - radius, y - radius, x + radius, y + radius), fill=(200, 30, 30))
    return np.array(image)


def bfs_components(mask: np.ndarray) -> int:
    seen, count = np.zeros_like(mask), 0
    for start in zip(*np.nonzero(mask), strict=True):
        if seen[start]:
            continue
        count, stack = count + 1, [start]
        seen[start] = True
        while stack:
            y, x = stack.pop()
            for ny, nx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                inside = 0 <= ny < mask.shape[0] and 0 <= nx < mask.shape[1]
                if inside and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    stack.append((ny, nx))
    return count


def test_count_objects():
    three = disks([(12, 12), (40, 20), (30, 48)])
    assert count_objects(three) == 3
    assert count_objects(disks([(20, 20), (28, 20)])) == 1  # overlapping disks are one blob
    speckled = three.copy()
    speckled[2, 60] = (0, 0, 0)  # one pixel: below min_area
    assert count_objects(speckled) == 3
    big = np.array(Image.fromarray(three).resize((512, 512), Image.Resampling.NEAREST))
    assert count_objects(big) == 3  # downsampled to 128 px first
    spiral = np.full((40, 40, 3), 255, np.uint8)
    spiral[2, 2:38] = spiral[2:38, 37] = spiral[37, 2:38] = spiral[6:38, 2] = 0
    spiral[6, 2:33] = spiral[6:33, 33] = spiral[32, 6:34] = spiral[10:33, 6] = 0
    assert count_objects(spiral, min_area=0) == 1
    rng = np.random.default_rng(0)
    for _ in range(20):
        mask = rng.random((24, 24)) < 0.45
        mask[0, :] = mask[-1, :] = mask[:, 0] = mask[:, -1] = False
        image = np.where(mask[..., None], 0, 255).astype(np.uint8).repeat(3, -1)
        assert count_objects(image, min_area=0) == bfs_components(mask)


def test_count_match():
    assert count_in_prompt("a photo of three apples") == 3
    assert count_in_prompt("2 dogs on a sofa") == 2
    assert count_in_prompt("two cats and two dogs") is None
    assert count_in_prompt("someone with a cat") is None
    image = to_tensor(disks([(12, 12), (40, 20), (30, 48)]))
    prompts = ["three red disks", "two red disks", "six red disks", "red disks"]
    scores = CountMatch()(image.expand(4, -1, -1, -1), prompts)
    torch.testing.assert_close(scores, torch.tensor([1.0, 0.5, 0.5, math.nan]), equal_nan=True)


# --- scoring in the background --------------------------------------------------------------


def test_background_scoring_equals_scoring_the_whole_batch_in_order():
    images = torch.rand(7, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    first = Constant(lambda images, prompts: images[:, 0, 0, 0], name="first")
    second = Constant(lambda images, prompts: images[:, 1, 2, 3], name="second")
    rewards = RewardSet([first, second])
    prompts = [f"p{i}" for i in range(7)]
    metadata = [{"i": i} for i in range(7)]
    background = BackgroundScoring(rewards, prompts, metadata)
    for start in range(0, 7, 3):
        background.submit(slice(start, start + 3), images[start : start + 3])
    values, seconds = background.collect()
    torch.testing.assert_close(values, rewards(images, prompts, metadata).values)
    assert first.chunks == [3, 3, 1, 7] and first.metadata == metadata
    assert set(seconds) == {"first", "second"}


def test_background_scoring_raises_the_reward_error_on_collect():
    def broken(images, prompts):
        raise RuntimeError("model exploded")

    background = BackgroundScoring(RewardSet([Constant(broken, name="broken")]), ["a", "b"])
    background.submit(slice(0, 1), torch.rand(1, 3, 4, 4))
    background.submit(slice(1, 2), torch.rand(1, 3, 4, 4))
    with pytest.raises(RewardError, match="'broken' failed: model exploded"):
        background.collect()
