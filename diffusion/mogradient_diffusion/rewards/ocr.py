"""Text-rendering reward: does the image show the text the prompt puts in double quotes?

Scoring follows the Flow-GRPO / DiffusionNFT / MARBLE OCR reward: the target is the text
between the first pair of double quotes; target and recognized text are lowercased
and stripped of spaces; a target contained in the recognized text scores 1, otherwise
``max(0, 1 - levenshtein(recognized, target) / len(target))``; prompts without quoted
text score NaN. The references read the text with PaddleOCR (lines concatenated);
here Tesseract reads it, which needs no model download, on a grayscale copy (Tesseract
5 misses dark text on mid-tone color backgrounds it reads fine in grayscale) upscaled
so its short side reaches ``min_side`` pixels (by at most 4x). Images are read in a
thread pool: each read is a ``tesseract`` subprocess (~0.15 s), so threads overlap them.
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from .base import Metadata, Reward, nan_scores, to_uint8_images
from .registry import register_reward

INSTALL_HINT = "install it with `apt-get install tesseract-ocr` (Debian/Ubuntu)"
# Upscaling helps Tesseract up to a point: measured on rendered text, 3-6x read best and
# 8x or more (glyphs hundreds of pixels tall) started to fail.
MAX_UPSCALE = 4.0


def quoted_text(prompt: str) -> str | None:
    """The text between the first two double quotes; None when there is none (n/a)."""
    parts = prompt.split('"')
    if len(parts) < 3 or not parts[1].strip():
        return None
    return parts[1]


def normalize_text(text: str) -> str:
    """Lowercase without whitespace: the references drop spaces and join OCR lines."""
    return "".join(text.split()).lower()


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions cost 1), two-row DP."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            current.append(
                min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b))
            )
        previous = current
    return previous[-1]


def text_match_score(recognized: str, target: str, substring_match: bool = True) -> float:
    """``max(0, 1 - levenshtein / len(target))`` on normalized text, in [0, 1].

    With ``substring_match`` (the references' rule) a target found inside longer
    recognized text scores 1: text elsewhere in the scene is not penalized.
    """
    recognized, target = normalize_text(recognized), normalize_text(target)
    if not target:
        raise ValueError("the target text is empty after normalization")
    if substring_match and target in recognized:
        return 1.0
    if len(recognized) >= 2 * len(target):  # distance >= length difference >= len(target)
        return 0.0
    return max(0.0, 1.0 - levenshtein(recognized, target) / len(target))


@register_reward
class OcrReward(Reward):
    """Tesseract OCR of the quoted prompt text; NaN for prompts without quoted text.

    Options: ``psm`` (Tesseract page segmentation mode; 3, its default, read our scene
    tests best, 7 suits single-line crops), ``lang``, ``min_side`` (upscale target),
    ``workers`` (threads; default: CPU count), ``timeout`` (seconds per image; a hung
    read raises rather than stalls training), ``tesseract_cmd`` (binary path; pytesseract
    keeps it process-wide).
    """

    name = "ocr"
    value_range = (0.0, 1.0)

    def __init__(
        self,
        psm: int = 3,
        lang: str = "eng",
        min_side: int = 512,
        workers: int | None = None,
        timeout: float = 60.0,
        substring_match: bool = True,
        tesseract_cmd: str | None = None,
        device: str | torch.device | None = None,
        batch_size: int | None = None,
    ):
        super().__init__(device, batch_size)
        try:
            import pytesseract
        except ImportError as exc:
            raise ImportError(
                "the ocr reward needs pytesseract: pip install 'mogradient[diffusion]'"
            ) from exc
        command = tesseract_cmd or pytesseract.pytesseract.tesseract_cmd
        if shutil.which(command) is None:
            raise RuntimeError(
                f"the ocr reward needs the Tesseract binary {command!r}: "
                f"{INSTALL_HINT}, or pass tesseract_cmd=<path>"
            )
        if tesseract_cmd is not None:
            pytesseract.pytesseract.tesseract_cmd = tesseract_cmd
        languages = pytesseract.get_languages(config="")
        if lang not in languages:
            raise ValueError(
                f"Tesseract has no {lang!r} language data (has {languages}); install it with "
                f"`apt-get install tesseract-ocr-{lang}`"
            )
        if not 0 <= psm <= 13:
            raise ValueError(f"psm must be a Tesseract page segmentation mode 0..13, got {psm}")
        self._pytesseract = pytesseract
        self.config = f"--psm {psm}"
        self.lang = lang
        self.min_side = min_side
        self.workers = workers
        self.timeout = timeout
        self.substring_match = substring_match

    def read_text(self, image: np.ndarray) -> str:
        """Tesseract's reading of one [H, W, 3] uint8 image (grayscale, upscaled <= 4x)."""
        pil = Image.fromarray(image).convert("L")
        short = min(pil.size)
        if short < self.min_side:
            scale = min(self.min_side / short, MAX_UPSCALE)
            size = (round(pil.width * scale), round(pil.height * scale))
            pil = pil.resize(size, Image.Resampling.BICUBIC)
        return self._pytesseract.image_to_string(
            pil, lang=self.lang, config=self.config, timeout=self.timeout
        )

    def score(self, images: Tensor, prompts: list[str], metadata: Metadata | None) -> Tensor:
        targets = [quoted_text(p) for p in prompts]
        todo = [i for i, target in enumerate(targets) if target is not None]
        scores = nan_scores(len(prompts))
        if not todo:
            return scores
        arrays = to_uint8_images(images[todo])
        workers = min(len(todo), self.workers or os.cpu_count() or 1)
        with ThreadPoolExecutor(max_workers=workers) as pool:
            texts = list(pool.map(self.read_text, arrays))
        for i, text in zip(todo, texts, strict=True):
            scores[i] = text_match_score(text, targets[i], self.substring_match)
        return scores
