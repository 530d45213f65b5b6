"""A character-level reader of the world's signs: the graded OCR training reward's eyes.

Tesseract reads a sign only once every letter is crisp, so on the samples of a small
base model it scores 0 almost everywhere and gives RL nothing to climb. This reader
knows where ``world`` draws a sign's letters (the word centred on the sign, in the
default font) and reads each letter cell on its own: the grayscale cell, at the best of
a few pixel shifts, is matched (Pearson correlation) against every capital letter drawn
alone at that place, and the best match is the letter read. A smudge shaped like the
right letter is read right before the whole word is legible, so the share of letters
read grows smoothly with legibility.

It is a template matcher, not a general OCR: it reads the world's layout and font only,
and a policy could satisfy it with letters Tesseract cannot read (which is why
``mini_ocr_strict``, Tesseract, stays the held-out metric).
"""

from __future__ import annotations

import string
from functools import lru_cache

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from .world import SIGN_COLOR, SIZE, Scene, render

LETTERS = string.ascii_uppercase
SHIFT = 2  # pixels the cells are searched over in each direction
ROWS = slice(22, 43)  # the text band of the sign at 64 px (centre 32, font size 20)


def _font() -> ImageFont.FreeTypeFont:
    return ImageFont.load_default(size=20)


@lru_cache(maxsize=64)
def letter_cells(word: str) -> tuple[tuple[int, int], ...]:
    """Column range [start, stop) of each letter of ``word`` as the world draws it at 64 px."""
    font = _font()
    left = SIZE / 2 - font.getlength(word) / 2
    cells = []
    for i in range(len(word)):
        start = left + font.getlength(word[:i])
        stop = left + font.getlength(word[: i + 1])
        cells.append((int(np.floor(start)), int(np.ceil(stop))))
    return tuple(cells)


@lru_cache(maxsize=64)
def _templates(word: str) -> np.ndarray:
    """[letters of word, 26, rows, cols] grayscale cells: each capital drawn alone there."""
    font = _font()
    cells = letter_cells(word)
    width = max(stop - start for start, stop in cells) + 2 * SHIFT
    out = np.zeros((len(word), len(LETTERS), ROWS.stop - ROWS.start, width), dtype=np.float32)
    for i, (start, stop) in enumerate(cells):
        centre = (start + stop) / 2
        for j, letter in enumerate(LETTERS):
            image = render(Scene(background=SIGN_COLOR, text=" "))
            ImageDraw.Draw(image).text(
                (centre, SIZE / 2), letter, fill=(10, 10, 10), font=font, anchor="mm"
            )
            gray = np.asarray(image.convert("L"), dtype=np.float32)
            out[i, j] = _cell(gray, start, width)
    return _standardise(out)


def _cell(gray: np.ndarray, start: int, width: int, dy: int = 0, dx: int = 0) -> np.ndarray:
    """The [rows, width] window of a letter cell (widened by SHIFT each side), shifted."""
    x0 = start - SHIFT + dx
    padded = np.pad(gray, SHIFT + 1, mode="edge")
    offset = SHIFT + 1
    return padded[
        ROWS.start + dy + offset : ROWS.stop + dy + offset, x0 + offset : x0 + width + offset
    ]


def _standardise(x: np.ndarray) -> np.ndarray:
    """Zero mean, unit norm over the last two axes (flat cells stay zero)."""
    x = x - x.mean(axis=(-2, -1), keepdims=True)
    norm = np.sqrt((x**2).sum(axis=(-2, -1), keepdims=True))
    return x / np.maximum(norm, 1e-6)


def world_gray(image: np.ndarray) -> np.ndarray:
    """[64, 64] float32 grayscale in [0, 255] of a [H, W, 3] uint8 image, box-resized to the
    world's 64 px if it has another size: where the sign's layout is known."""
    pil = Image.fromarray(np.asarray(image, dtype=np.uint8)).convert("L")
    if pil.size != (SIZE, SIZE):
        pil = pil.resize((SIZE, SIZE), Image.Resampling.BOX)
    return np.asarray(pil, dtype=np.float32)


def read_sign_letters(image: np.ndarray, word: str) -> str:
    """The capitals read in each letter cell of ``word``'s layout in a [H, W, 3] uint8 image.

    Images of another size are resized to the world's 64 px first. A cell with no
    contrast at all (a blank sign) reads as a space.
    """
    word = word.upper()
    gray = world_gray(image)
    templates = _templates(word)
    width = templates.shape[-1]
    read = []
    for i, (start, _) in enumerate(letter_cells(word)):
        windows = np.stack(
            [
                _cell(gray, start, width, dy, dx)
                for dy in range(-SHIFT, SHIFT + 1)
                for dx in range(-SHIFT, SHIFT + 1)
            ]
        )
        if windows.std() < 1.0:
            read.append(" ")
            continue
        scores = np.einsum("shw,lhw->sl", _standardise(windows), templates[i])
        read.append(LETTERS[int(scores.max(axis=0).argmax())])
    return "".join(read)
