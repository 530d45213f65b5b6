"""The miniature's rule-based rewards: counts, GenEval binding and strict OCR on ``world`` prompts.

All read the GenEval-format metadata ``world`` writes (``tag``, ``include``, ``text``)
and are NaN where it does not apply (another tag, or no metadata). The shape rewards run
``vision.detect_shapes`` (the GenEval detector analogue), keep detections scoring above
GenEval's 0.3 threshold with ``geneval_rules.select_objects`` and score them:

* ``mini_count`` (tags ``counting`` and ``general``, whose one-object scenes have a
  count of one): the training reward, half rule and half blob term. The rule term is
  the mean over include entries of ``max(0, 1 - |found - asked| / asked)`` where
  ``found`` counts kept detections of the entry's shape *and* color (Flow-GRPO's count
  term, clamped per entry); the blob term is the same with ``found`` counting every
  blob of the entry's color, whatever its shape or detector score. A weak base model
  draws blobs long before it draws clean shapes: the rule term alone is 0 on most of
  its samples and on every sample of half its groups (no within-group signal).
* ``mini_count_strict`` (``counting``): 1 if every entry's count is exact, else 0. Note
  GenEval's own rule (``mini_binding_strict`` on counting prompts) accepts ``>= count``;
  this held-out metric does not: four squares for "three squares" fail here.
* ``mini_binding`` (``color_attr``, ``position``, ``general``): the training reward,
  half ``geneval_rules.partial_score`` (Flow-GRPO's graded GenEval reward) and half a
  blob term: per include entry, whether a blob of its color is there, and for a
  position entry whether the largest blobs of the two colors stand in the relation.
* ``mini_binding_strict`` (``color_attr``, ``position``, ``counting``):
  ``geneval_rules.strict_correct``, GenEval's accuracy (the held-out metric).
* ``mini_sign`` (``text``): the training reward of the text axis, how legibly a sign is
  drawn, whatever it says: crisp ink on a clean board, as much ink as the word needs.
* ``mini_ocr`` (``text``): the character-level reader ``reader``: the share of the
  word's letters read right where the sign draws them (a held-out metric).
* ``mini_noise``: uniform noise where another reward (option ``like``) applies, the
  control row that tells drift (any training moves every score) from learning.
* ``mini_ocr_strict`` (``text``): 1 if Tesseract's normalized reading contains the
  metadata's word (so an exact reading passes), else 0: the exact-read case of the
  training ``ocr`` reward, which it wraps.

GenEval keeps only detections above 0.9 on counting prompts, because Mask2Former emits
low-confidence duplicates of one object; connected components never duplicate, so one
threshold (``threshold``, default GenEval's 0.3) serves every tag here.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from mogradient_diffusion.rewards.base import (
    Metadata,
    Reward,
    nan_scores,
    score_each_image,
    to_uint8_images,
)
from mogradient_diffusion.rewards.geneval_rules import (
    THRESHOLD,
    Detection,
    Objects,
    partial_score,
    select_objects,
    strict_correct,
    validate_metadata,
)
from mogradient_diffusion.rewards.ocr import OcrReward
from mogradient_diffusion.rewards.registry import register_reward

from .reader import read_sign_letters
from .sign import sign_legibility
from .vision import detect_shapes_batch


def count_found(objects: Objects, entry: Mapping[str, Any]) -> int:
    """How many kept detections match an include entry's shape and (if given) color."""
    return sum(
        "color" not in entry or det.color == entry["color"]
        for det in objects.get(entry["class"], ())
    )


def count_score(objects: Objects, metadata: Mapping[str, Any]) -> float:
    """Mean over include entries of ``max(0, 1 - |found - asked| / asked)``, in [0, 1]."""
    terms = []
    for entry in metadata["include"]:
        asked = int(entry.get("count", 1))
        terms.append(max(0.0, 1.0 - abs(count_found(objects, entry) - asked) / asked))
    return sum(terms) / len(terms) if terms else 0.0


def count_exact(objects: Objects, metadata: Mapping[str, Any]) -> bool:
    """Every include entry found exactly as often as asked (not GenEval's ``>=``)."""
    return all(
        count_found(objects, entry) == int(entry.get("count", 1)) for entry in metadata["include"]
    )


def blob_count_score(blobs: list[Detection], metadata: Mapping[str, Any]) -> float:
    """``count_score`` counting every blob of an entry's color, whatever its shape."""
    terms = []
    for entry in metadata["include"]:
        asked = int(entry.get("count", 1))
        found = sum(blob.color == entry["color"] for blob in blobs)
        terms.append(max(0.0, 1.0 - abs(found - asked) / asked))
    return sum(terms) / len(terms) if terms else 0.0


def _centre(blob: Detection) -> tuple[float, float]:
    x1, y1, x2, y2 = blob.box
    return (x1 + x2) / 2, (y1 + y2) / 2


def _relation_holds(a: Detection, b: Detection, relation: str) -> bool:
    """Whether blob ``a`` is ``relation`` blob ``b``: along the relation's axis, mostly."""
    (ax, ay), (bx, by) = _centre(a), _centre(b)
    dx, dy = ax - bx, ay - by
    return {
        "left of": dx < -abs(dy),
        "right of": dx > abs(dy),
        "above": dy < -abs(dx),
        "below": dy > abs(dx),
    }[relation]


def blob_binding_score(blobs: list[Detection], metadata: Mapping[str, Any]) -> float:
    """Per include entry: a blob of its color is there; per position entry: the largest
    blobs of the two colors stand in the relation. Mean of the terms, in [0, 1]."""
    entries = metadata["include"]
    largest: list[Detection | None] = []
    for entry in entries:
        mine = [blob for blob in blobs if blob.color == entry["color"]]
        largest.append(max(mine, key=lambda blob: int(blob.mask.sum()), default=None))
    terms = [float(blob is not None) for blob in largest]
    for entry, blob in zip(entries, largest, strict=True):
        if "position" in entry:
            relation, target = entry["position"]
            other = largest[int(target)]
            ok = blob is not None and other is not None and _relation_holds(blob, other, relation)
            terms.append(float(ok))
    return sum(terms) / len(terms) if terms else 0.0


class MiniShapeReward(Reward):
    """Base of the detector-based rewards: NaN outside ``tags``, else ``score_objects``.

    Options: ``threshold`` (detection score a kept object must exceed) and the detector's
    ``tolerance``, ``max_residual``, ``min_alpha``, ``min_area`` (see ``vision``).
    """

    tags: ClassVar[frozenset[str]]
    value_range = (0.0, 1.0)

    def __init__(
        self,
        threshold: float = THRESHOLD,
        tolerance: float = 40.0,
        max_residual: float = 60.0,
        min_alpha: float = 0.5,
        min_area: float = 12.0,
        device: str | torch.device | None = None,
        batch_size: int | None = None,
    ):
        super().__init__(device, batch_size)
        if not 0 <= threshold < 1:
            raise ValueError(f"{self.name}: threshold must lie in [0, 1), got {threshold}")
        self.threshold = threshold
        self.detector_options = {
            "tolerance": tolerance,
            "max_residual": max_residual,
            "min_alpha": min_alpha,
            "min_area": min_area,
        }

    def applies(self, metadata: Mapping[str, Any] | None) -> bool:
        """Whether a sample's metadata carries one of this reward's tags."""
        return isinstance(metadata, Mapping) and metadata.get("tag") in self.tags

    def detect(self, images: Tensor) -> list[list[Detection]]:
        """Detections of [b, 3, H, W] images in [0, 1] (all shapes, before thresholding)."""
        return detect_shapes_batch(to_uint8_images(images), **self.detector_options)

    @abstractmethod
    def score_objects(
        self, objects: Objects, metadata: Mapping[str, Any], blobs: list[Detection]
    ) -> float:
        """The score of one applicable image from its kept detections, by class, and
        every detected color blob (before the score threshold)."""

    def score(self, images: Tensor, prompts: list[str], metadata: Metadata | None) -> Tensor:
        scores = nan_scores(len(prompts))
        if metadata is None:
            return scores
        todo = [i for i, meta in enumerate(metadata) if self.applies(meta)]
        if not todo:
            return scores
        for i in todo:
            validate_metadata(metadata[i])
        for i, detections in zip(todo, self.detect(images[todo]), strict=True):
            objects = select_objects(detections, self.threshold)
            scores[i] = float(self.score_objects(objects, metadata[i], detections))
        return scores


@register_reward
class MiniCount(MiniShapeReward):
    """Graded count of color-and-shape-matched objects on counting prompts (training)."""

    name = "mini_count"
    tags = frozenset({"counting", "general"})

    def score_objects(
        self, objects: Objects, metadata: Mapping[str, Any], blobs: list[Detection]
    ) -> float:
        return (count_score(objects, metadata) + blob_count_score(blobs, metadata)) / 2


@register_reward
class MiniCountStrict(MiniShapeReward):
    """1 if every count on a counting prompt is exact, else 0 (held-out metric)."""

    name = "mini_count_strict"
    tags = frozenset({"counting"})

    def score_objects(
        self, objects: Objects, metadata: Mapping[str, Any], blobs: list[Detection]
    ) -> float:
        return float(count_exact(objects, metadata))


@register_reward
class MiniBinding(MiniShapeReward):
    """Flow-GRPO's graded GenEval reward on color-binding and position prompts."""

    name = "mini_binding"
    tags = frozenset({"color_attr", "position", "general"})

    def score_objects(
        self, objects: Objects, metadata: Mapping[str, Any], blobs: list[Detection]
    ) -> float:
        return (partial_score(objects, metadata) + blob_binding_score(blobs, metadata)) / 2


@register_reward
class MiniBindingStrict(MiniShapeReward):
    """GenEval's accuracy on color, position and counting prompts (held-out metric)."""

    name = "mini_binding_strict"
    tags = frozenset({"color_attr", "position", "counting"})

    def score_objects(
        self, objects: Objects, metadata: Mapping[str, Any], blobs: list[Detection]
    ) -> float:
        return float(strict_correct(objects, metadata))


class SignReward(Reward):
    """A score read off the sign of each text prompt's image (NaN on other prompts)."""

    value_range = (0.0, 1.0)

    @abstractmethod
    def score_sign(self, image: np.ndarray, word: str) -> float:
        """Score of one [H, W, 3] uint8 image whose sign should show ``word``."""

    def score(self, images: Tensor, prompts: list[str], metadata: Metadata | None) -> Tensor:
        if metadata is None:
            return nan_scores(len(prompts))
        targets = [MiniOcrStrict.target(meta) for meta in metadata]
        todo = [i for i, word in enumerate(targets) if word is not None]
        return score_each_image(
            images, len(prompts), todo, lambda i, image: self.score_sign(image, targets[i])
        )


@register_reward
class MiniOcr(SignReward):
    """Share of the sign word's letters the character-level reader reads right.

    Graded where Tesseract (``mini_ocr_strict``) is all or nothing and reads nothing a
    weak base model draws: a blurry sign whose first letter is right already scores 1/3.
    """

    name = "mini_ocr"

    def score_sign(self, image: np.ndarray, word: str) -> float:
        read = read_sign_letters(image, word)
        return sum(a == b for a, b in zip(read, word.upper(), strict=True)) / len(word)


@register_reward
class MiniSign(SignReward):
    """How legibly the sign of a text prompt is drawn (``sign.sign_legibility``), in [0, 1].

    The text axis's training reward. It does not read: at 64 px the base model's letters
    on held-out words are at chance for the reader (``mini_ocr``), so no policy in the
    CPU budget learns to spell a word it was not trained on, but a crisper sign with the
    right amount of ink is learnable and carries over to unseen words.
    """

    name = "mini_sign"

    def score_sign(self, image: np.ndarray, word: str) -> float:
        return sign_legibility(image, word)


@register_reward
class MiniNoise(Reward):
    """Uniform noise in [0, 1] wherever the reward ``like`` applies (NaN elsewhere).

    The control of a specialist run: the same prompts carry signal-free advantages, so
    whatever a reward does under this training is drift, not learning. ``seed`` seeds a
    private generator, advanced once per scored batch.
    """

    name = "mini_noise"
    value_range = (0.0, 1.0)

    def __init__(
        self,
        like: str,
        seed: int = 0,
        device: str | torch.device | None = None,
        batch_size: int | None = None,
    ):
        super().__init__(device, batch_size)
        from mogradient_diffusion.rewards.registry import make_reward

        self.like = make_reward(like)
        self.generator = torch.Generator().manual_seed(seed)

    def score(self, images: Tensor, prompts: list[str], metadata: Metadata | None) -> Tensor:
        blank = torch.zeros(len(prompts), 3, 8, 8)  # applicability needs no pixels
        applies = ~torch.isnan(self.like.score(blank, prompts, metadata))
        noise = torch.rand(len(prompts), generator=self.generator)
        return torch.where(applies, noise, torch.full_like(noise, float("nan")))


@register_reward
class MiniOcrStrict(Reward):
    """1 if Tesseract reads the sign's word (substring rule) on text prompts, else 0.

    Wraps the training ``ocr`` reward (its options: ``psm``, ``lang``, ``min_side``,
    ``workers``, ``timeout``, ``tesseract_cmd``), reading with the same settings, so this
    is 1 exactly where ``ocr`` scores 1 against the metadata's ``text``.
    """

    name = "mini_ocr_strict"
    value_range = (0.0, 1.0)

    def __init__(
        self,
        device: str | torch.device | None = None,
        batch_size: int | None = None,
        **ocr_options: Any,
    ):
        super().__init__(device, batch_size)
        if "substring_match" in ocr_options:
            raise TypeError("mini_ocr_strict always uses the substring rule")
        self.ocr = OcrReward(substring_match=True, **ocr_options)

    @staticmethod
    def target(metadata: Mapping[str, Any] | None) -> str | None:
        """The word a text prompt's sign must show; None where the reward is n/a."""
        if not isinstance(metadata, Mapping) or metadata.get("tag") != "text":
            return None
        word = metadata.get("text")
        if not isinstance(word, str) or not word.strip() or '"' in word:
            raise ValueError(f"mini_ocr_strict: text metadata needs a word, got {word!r}")
        return word

    def score(self, images: Tensor, prompts: list[str], metadata: Metadata | None) -> Tensor:
        scores = nan_scores(len(prompts))
        if metadata is None:
            return scores
        targets = [self.target(meta) for meta in metadata]
        todo = [i for i, word in enumerate(targets) if word is not None]
        if todo:
            quoted: Sequence[str] = [f'"{targets[i]}"' for i in todo]
            read = self.ocr(images[todo], quoted)
            scores[todo] = (read == 1.0).float()
        return scores
