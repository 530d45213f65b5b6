"""GenEval rewards: detect objects with Mask2Former, then score against the prompt's metadata.

Pipeline, as in GenEval (djghosh13/geneval, ``evaluate_images.py``): a COCO instance
segmenter finds objects; per class the confident ones are kept (``geneval_rules``); a
CLIP ViT-L/14 zero-shot classifier names the color of each object a prompt asks a
color of; ``geneval_rules`` turns that into a score. ``geneval`` is Flow-GRPO's graded
training reward in [0, 1]; ``geneval_strict`` is GenEval's 0/1 accuracy, for evaluation.
Both are NaN on samples without GenEval metadata (no mapping, or no ``include``).

The detector differs from the reference's: GenEval loads mmdetection's
``mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco`` checkpoint; here it is transformers'
``Mask2FormerForUniversalSegmentation``, normally ``facebook/mask2former-swin-small-coco-instance``
(the original Mask2Former release converted). Same architecture family (Swin-S, 100
queries) and training data (COCO instances), but a different training run and
post-processing details (transformers thresholds masks on a 384 x 384 upsampling of the
quarter-resolution logits, then resizes them nearest-neighbour, where mmdet thresholds at
full resolution), so scores differ slightly from published GenEval numbers. Images are resized
to a short side of 800 (long side at most 1333) as both the mmdet and the original
Mask2Former test pipelines do, not to the 384 x 384 the converted checkpoint's
``preprocessor_config.json`` asks for; ``detector_size=None`` keeps the latter.
"""

from __future__ import annotations

import math
import os
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .base import Metadata, Reward, nan_scores, to_uint8_images
from .clip_backbone import CLIP_FILES, ClipBackbone
from .geneval_rules import (
    COLOR_TEMPLATES,
    COLORS,
    COUNTING_THRESHOLD,
    MAX_OBJECTS,
    NMS_THRESHOLD,
    POSITION_THRESHOLD,
    THRESHOLD,
    Detection,
    color_classes,
    confidence_threshold,
    geneval_class_name,
    is_geneval_metadata,
    mask_to_box,
    object_crop,
    partial_score,
    select_objects,
    strict_correct,
    validate_metadata,
)
from .local_weights import WEIGHT_FILES, MissingWeightsError, require_files
from .registry import register_reward

HOW_TO_GET = (
    "Get the detector with `huggingface-cli download "
    "facebook/mask2former-swin-small-coco-instance --local-dir <dir>` and pass it as `path`; "
    "prompts that name a color also need `huggingface-cli download "
    "openai/clip-vit-large-patch14 --local-dir <dir>`, passed as `clip_path`."
)
DETECTOR_FILES = ("config.json", WEIGHT_FILES, "preprocessor_config.json")
# The mmdet / Mask2Former test-time resize: short side 800, long side at most 1333.
DETECTOR_SIZE = 800
_MAX_LONG_SIDE = 1333


@dataclass(frozen=True, eq=False)
class GenEvalOutcome:
    """Both scores of one image, and the kept objects per class they were computed from."""

    correct: bool
    score: float
    objects: dict[str, list[Detection]]


class GenEvalBase(Reward):
    """Detector, color classifier and rules shared by ``geneval`` and ``geneval_strict``.

    The CLIP color model loads on the first prompt that names a color, so counting or
    position-only runs never pay for it; a given ``clip_path`` is checked at once, and a
    missing one raises ``MissingWeightsError`` when a color is first needed.
    """

    value_range = (0.0, 1.0)

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        clip_path: str | os.PathLike | None = None,
        threshold: float = THRESHOLD,
        counting_threshold: float = COUNTING_THRESHOLD,
        max_objects: int = MAX_OBJECTS,
        nms_threshold: float = NMS_THRESHOLD,
        position_threshold: float = POSITION_THRESHOLD,
        detector_size: int | None = DETECTOR_SIZE,
        device: str | torch.device | None = None,
        batch_size: int | None = None,
    ):
        super().__init__(device, batch_size)
        if not (0 <= threshold < 1 and 0 <= counting_threshold < 1):
            raise ValueError(
                f"{self.name}: thresholds must lie in [0, 1), got {threshold}, {counting_threshold}"
            )
        if max_objects < 1 or not 0 < nms_threshold <= 1 or position_threshold < 0:
            raise ValueError(
                f"{self.name}: need max_objects >= 1, 0 < nms_threshold <= 1 and "
                f"position_threshold >= 0, got {max_objects}, {nms_threshold}, "
                f"{position_threshold}"
            )
        if detector_size is not None and detector_size < 32:
            raise ValueError(f"{self.name}: detector_size must be >= 32 or None")
        self.threshold = threshold
        self.counting_threshold = counting_threshold
        self.max_objects = max_objects
        self.nms_threshold = nms_threshold
        self.position_threshold = position_threshold

        from transformers import Mask2FormerForUniversalSegmentation, Mask2FormerImageProcessorPil

        detector_dir = require_files(self.name, path, DETECTOR_FILES, HOW_TO_GET)
        self.clip_dir = (
            None
            if clip_path is None
            else require_files(self.name, clip_path, CLIP_FILES, HOW_TO_GET)
        )
        overrides: dict[str, Any] = {}
        if detector_size is not None:
            overrides["size"] = {
                "shortest_edge": detector_size,
                "longest_edge": max(detector_size, _MAX_LONG_SIDE),
            }
        self.processor = Mask2FormerImageProcessorPil.from_pretrained(
            detector_dir, local_files_only=True, **overrides
        )
        self.detector = Mask2FormerForUniversalSegmentation.from_pretrained(
            detector_dir, local_files_only=True
        )
        self.detector.requires_grad_(False).eval().to(self.device)
        id2label = self.detector.config.id2label
        self.class_names = [geneval_class_name(id2label[i]) for i in range(len(id2label))]
        self._clip: ClipBackbone | None = None
        self._color_classifiers: dict[str, Tensor] = {}

    def to(self, device: str | torch.device) -> GenEvalBase:
        super().to(device)
        self.detector.to(self.device)
        if self._clip is not None:
            self._clip.to(self.device)
        self._color_classifiers = {k: v.to(self.device) for k, v in self._color_classifiers.items()}
        return self

    @abstractmethod
    def _pick(self, outcome: GenEvalOutcome) -> float:
        """The reward's number from an image's outcome."""

    def score(self, images: Tensor, prompts: list[str], metadata: Metadata | None) -> Tensor:
        scores = nan_scores(len(prompts))
        for i, outcome in enumerate(self.evaluate(images, metadata)):
            if outcome is not None:
                scores[i] = self._pick(outcome)
        return scores

    def evaluate(self, images: Tensor, metadata: Metadata | None) -> list[GenEvalOutcome | None]:
        """Strict and partial scores of each image (None without GenEval metadata).

        One detector pass yields both, so an evaluation can report GenEval accuracy and
        the training reward together.
        """
        metas: Sequence[Mapping[str, Any] | None] = (
            [None] * images.shape[0] if metadata is None else metadata
        )
        todo = [i for i, meta in enumerate(metas) if is_geneval_metadata(meta)]
        outcomes: list[GenEvalOutcome | None] = [None] * len(metas)
        if not todo:
            return outcomes
        for i in todo:
            self._check_metadata(metas[i])
        arrays = to_uint8_images(images[todo])
        min_score = min(self.threshold, self.counting_threshold)
        per_image = []
        for array, detections, i in zip(arrays, self.detect(arrays, min_score), todo, strict=True):
            meta = metas[i]
            threshold = confidence_threshold(meta, self.threshold, self.counting_threshold)
            objects = select_objects(detections, threshold, self.max_objects, self.nms_threshold)
            per_image.append((i, meta, array, objects))
        self._classify_colors(per_image)
        for i, meta, _, objects in per_image:
            outcomes[i] = GenEvalOutcome(
                correct=strict_correct(objects, meta, self.position_threshold),
                score=partial_score(objects, meta, self.position_threshold),
                objects=objects,
            )
        return outcomes

    def _check_metadata(self, meta: Mapping[str, Any]) -> None:
        try:
            validate_metadata(meta)
        except ValueError as exc:
            raise ValueError(f"{self.name}: {exc}") from exc
        known = set(self.class_names)
        for key in ("include", "exclude"):
            for entry in meta.get(key) or ():
                if entry["class"] not in known:
                    raise ValueError(
                        f"{self.name}: metadata class {entry['class']!r} is not one the "
                        f"detector knows ({len(known)} classes from its config's id2label)"
                    )

    @torch.no_grad()
    def detect(self, images: np.ndarray, min_score: float = 0.0) -> list[list[Detection]]:
        """Instances of [B, H, W, 3] uint8 images: label, score, mask and box of each.

        Keeps Mask2Former's top queries (as GenEval's detector does) with score >=
        ``min_score``; boxes are the masks' tight boxes, as mmdet derives them.
        """
        batch = self.processor(images=list(images), return_tensors="pt")
        pixel_values = batch["pixel_values"].to(self.device, self.detector.dtype)
        pixel_mask = batch.get("pixel_mask")
        if pixel_mask is not None:
            pixel_mask = pixel_mask.to(self.device)
        outputs = self.detector(pixel_values=pixel_values, pixel_mask=pixel_mask)
        if pixel_mask is not None:
            outputs.masks_queries_logits = _unpadded(
                outputs.masks_queries_logits, pixel_mask, pixel_values.shape[-2:]
            )
        # The post-processing writes the masks into a map it makes on the CPU, indexing it
        # with masks on the logits' device (an error on a GPU): it gets host copies.
        outputs.class_queries_logits = outputs.class_queries_logits.cpu()
        outputs.masks_queries_logits = outputs.masks_queries_logits.cpu()
        height, width = images.shape[1:3]
        results = self.processor.post_process_instance_segmentation(
            outputs,
            threshold=min_score,
            target_sizes=[(height, width)] * len(images),
            return_binary_maps=True,
        )
        detections = []
        for result in results:
            segments = result["segments_info"]
            masks = result["segmentation"].bool().cpu().numpy() if segments else []
            found = []
            for segment, mask in zip(segments, masks, strict=True):
                if mask.any():
                    found.append(
                        Detection(
                            label=self.class_names[segment["label_id"]],
                            score=float(segment["score"]),
                            box=mask_to_box(mask),
                            mask=mask,
                        )
                    )
            detections.append(found)
        return detections

    def _classify_colors(self, per_image: list) -> None:
        """Set ``color`` on the kept objects of classes whose prompt names a color."""
        jobs = [
            (slot, label)
            for slot, (_, meta, _, objects) in enumerate(per_image)
            for label in sorted(color_classes(meta))
            if objects.get(label)
        ]
        if not jobs:
            return
        clip = self._clip_model()
        crops = [
            object_crop(per_image[slot][2], det)
            for slot, label in jobs
            for det in per_image[slot][3][label]
        ]
        # A list of differently sized uint8 crops: the CLIP processor resizes each.
        features = clip.image_features(crops)
        start = 0
        for slot, label in jobs:
            objects = per_image[slot][3]
            dets = objects[label]
            logits = features[start : start + len(dets)] @ self._color_classifier(label).T
            start += len(dets)
            objects[label] = [
                replace(det, color=COLORS[k])
                for det, k in zip(dets, logits.argmax(-1).tolist(), strict=True)
            ]

    def _clip_model(self) -> ClipBackbone:
        if self._clip is None:
            if self.clip_dir is None:
                raise MissingWeightsError(
                    f"reward {self.name!r}: a prompt names a color, which needs the CLIP "
                    f"color classifier; set the reward option `clip_path`. {HOW_TO_GET}"
                )
            self._clip = ClipBackbone(self.name, self.clip_dir, HOW_TO_GET, self.device)
        return self._clip

    def _color_classifier(self, label: str) -> Tensor:
        """[colors, E] zero-shot weights: per color the renormalised mean of its prompts."""
        if label not in self._color_classifiers:
            texts = [t.format(c=c, cls=label) for c in COLORS for t in COLOR_TEMPLATES]
            features = self._clip_model().text_features(texts)
            mean = features.reshape(len(COLORS), len(COLOR_TEMPLATES), -1).mean(1)
            self._color_classifiers[label] = mean / mean.norm(dim=-1, keepdim=True)
        return self._color_classifiers[label]


def _unpadded(mask_logits: Tensor, pixel_mask: Tensor, padded_size: torch.Size) -> Tensor:
    """Mask logits cut to the image area: the processor pads to a multiple of 32, and
    transformers' post-processing would otherwise stretch the padding into the masks."""
    height = int(pixel_mask[0].any(dim=1).sum())
    width = int(pixel_mask[0].any(dim=0).sum())
    rows = math.ceil(height * mask_logits.shape[-2] / padded_size[0])
    cols = math.ceil(width * mask_logits.shape[-1] / padded_size[1])
    return mask_logits[..., :rows, :cols]


@register_reward
class GenEval(GenEvalBase):
    """Flow-GRPO's graded GenEval reward in [0, 1] (see ``geneval_rules.partial_score``)."""

    name = "geneval"

    def _pick(self, outcome: GenEvalOutcome) -> float:
        return outcome.score


@register_reward
class GenEvalStrict(GenEvalBase):
    """GenEval's own 0/1 accuracy per image (``geneval_rules.strict_correct``)."""

    name = "geneval_strict"

    def _pick(self, outcome: GenEvalOutcome) -> float:
        return float(outcome.correct)
