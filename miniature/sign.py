"""Sign legibility: the text axis's graded training reward, read off the sign's pixels.

The world draws a word centred on a white board (``world._draw_sign``). A legible
rendering has three things a smudge lacks, each scored in [0, 1] on the grayscale image
(64 px, values in [0, 1]) and multiplied:

* **crisp ink**: the text band's pixels are near black or near white, not grey
  (mean ``|2 g - 1|``);
* **the right amount of ink**: the share of dark pixels in the band matches the word's
  clean render (``min(r, 1 / r)`` of the two shares; no ink scores 0);
* **a clean board**: the board's strips above and below the band are white.

It rewards how the sign is drawn, not what it says: a crisp sign of another word scores
high too. Reading stays with the held-out metrics (``mini_ocr``'s letter reader and
Tesseract's ``mini_ocr_strict``).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from .reader import world_gray
from .world import Scene, render

BAND = (slice(22, 43), slice(6, 58))  # rows, columns of the text at 64 px
BOARD_STRIPS = ((slice(17, 21), slice(6, 58)), (slice(44, 47), slice(6, 58)))
DARK = 0.5  # a band pixel darker than this is ink


def _gray(image: np.ndarray) -> np.ndarray:
    """[64, 64] float64 grayscale in [0, 1] of a [H, W, 3] uint8 image."""
    return world_gray(image).astype(np.float64) / 255.0


@lru_cache(maxsize=64)
def reference_ink(word: str) -> float:
    """Share of the text band that is ink when the world draws ``word`` cleanly."""
    gray = _gray(np.asarray(render(Scene(text=word))))
    return float((gray[BAND] < DARK).mean())


def sign_legibility(image: np.ndarray, word: str) -> float:
    """Crisp ink x the word's amount of ink x a clean board, in [0, 1]."""
    gray = _gray(image)
    band = gray[BAND]
    crisp = float(np.abs(2.0 * band - 1.0).mean())
    ink, wanted = float((band < DARK).mean()), reference_ink(word)
    ink_match = min(ink / wanted, wanted / ink) if ink > 0 else 0.0
    board = np.concatenate([gray[strip].ravel() for strip in BOARD_STRIPS])
    clean = float(1.0 - np.abs(1.0 - board).mean())
    return crisp * ink_match * clean
