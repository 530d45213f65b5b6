"""GenEval's scoring rules as pure functions on detections: no models, fully testable.

The reward (``geneval.py``) runs the detector and the color classifier and hands the
results here. Two scores come out of the same detections:

* ``strict_correct`` is GenEval's own per-image accuracy (djghosh13/geneval,
  ``evaluate_images.py``): include clauses must all hold, "at least ``count``" found,
  color and position checked on the ``count`` most confident objects; any exclude
  clause met fails the image.
* ``partial_score`` is the graded training reward of Flow-GRPO's GenEval reward server:
  the mean of per-clause terms, where counts must match exactly to earn the color and
  position terms. Its count term ``1 - |count - found| / count`` goes negative past
  ``2 * count`` objects; the final mean is clamped at 0 so the reward keeps the range
  [0, 1] (a policy cannot be pushed further by over-producing objects than by producing
  none, and advantage normalisation never sees a score outside the declared range).
  The reference server appends both 0.0 and 1.0 when a position is violated (the 1.0
  after its loop runs unconditionally); here a violated position is one 0.0 term.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# GenEval's constants (evaluate_images.py).
THRESHOLD = 0.3
COUNTING_THRESHOLD = 0.9
MAX_OBJECTS = 16
NMS_THRESHOLD = 1.0
POSITION_THRESHOLD = 0.1

COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
COLOR_TEMPLATES = (
    "a photo of a {c} {cls}",
    "a photo of a {c}-colored {cls}",
    "a photo of a {c} object",
)
RELATIONS = ("left of", "right of", "above", "below")
# Objects are composited over this grey before the color classifier sees their crop.
CROP_BACKGROUND = (153, 153, 153)

# The 80 COCO classes under the names GenEval's metadata uses (COCO order).
GENEVAL_CLASSES = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat",
    "traffic light", "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog",
    "horse", "sheep", "cow", "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella",
    "handbag", "tie", "suitcase", "frisbee", "skis", "snowboard", "sports ball", "kite",
    "baseball bat", "baseball glove", "skateboard", "surfboard", "tennis racket", "bottle",
    "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple", "sandwich",
    "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch",
    "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "computer mouse",
    "tv remote", "computer keyboard", "cell phone", "microwave", "oven", "toaster", "sink",
    "refrigerator", "book", "clock", "vase", "scissors", "teddy bear", "hair drier", "toothbrush",
)  # fmt: skip
# Detector checkpoints spell some classes differently (COCO's short names, PASCAL's).
_LABEL_ALIASES = {
    "mouse": "computer mouse",
    "remote": "tv remote",
    "keyboard": "computer keyboard",
    "motorbike": "motorcycle",
    "aeroplane": "airplane",
    "sofa": "couch",
    "pottedplant": "potted plant",
    "diningtable": "dining table",
    "tvmonitor": "tv",
    "tv monitor": "tv",
    "hair dryer": "hair drier",
    "doughnut": "donut",
    "cellphone": "cell phone",
}

Box = tuple[float, float, float, float]
Objects = Mapping[str, Sequence["Detection"]]


@dataclass(frozen=True, eq=False)
class Detection:
    """One detected instance: ``box`` is [x1, y1, x2, y2] in pixels, ``mask`` [H, W] bool.

    ``color`` is filled in by the color classifier, only for classes a prompt asks a
    color of.
    """

    label: str
    score: float
    box: Box
    mask: np.ndarray | None = None
    color: str | None = None


def geneval_class_name(label: str) -> str:
    """A detector's class name in GenEval's spelling ("keyboard" -> "computer keyboard")."""
    name = " ".join(label.lower().replace("_", " ").replace("-", " ").split())
    return _LABEL_ALIASES.get(name, name)


def mask_to_box(mask: np.ndarray) -> Box:
    """Tight box of a boolean mask in pixel-edge coordinates: [x_min, y_min, x_max+1, y_max+1]."""
    rows, cols = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
    if not rows.size:
        raise ValueError("mask_to_box: empty mask")
    return (float(cols[0]), float(rows[0]), float(cols[-1] + 1), float(rows[-1] + 1))


def box_iou(a: Box, b: Box) -> float:
    """Intersection over union of two [x1, y1, x2, y2] boxes (0 when both are empty)."""
    width = max(min(a[2], b[2]) - max(a[0], b[0]), 0.0)
    height = max(min(a[3], b[3]) - max(a[1], b[1]), 0.0)
    inter = width * height
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def select_objects(
    detections: Iterable[Detection],
    threshold: float = THRESHOLD,
    max_objects: int = MAX_OBJECTS,
    nms_threshold: float = NMS_THRESHOLD,
) -> dict[str, list[Detection]]:
    """Per class, GenEval's kept objects, most confident first.

    Sorted by score, kept if ``score > threshold``, capped at ``max_objects``, then a
    greedy NMS dropping any box whose IoU with a kept one reaches ``nms_threshold``;
    at 1.0 (GenEval's setting) NMS is off, so duplicates of one object all count.
    Classes with nothing kept are absent.
    """
    by_class: dict[str, list[Detection]] = {}
    for det in detections:
        by_class.setdefault(det.label, []).append(det)
    objects = {}
    for label, dets in by_class.items():
        ranked = sorted(dets, key=lambda d: d.score, reverse=True)
        ranked = [d for d in ranked if d.score > threshold][:max_objects]
        if nms_threshold < 1:
            kept: list[Detection] = []
            for det in ranked:
                if all(box_iou(det.box, k.box) < nms_threshold for k in kept):
                    kept.append(det)
            ranked = kept
        if ranked:
            objects[label] = ranked
    return objects


def relations(box_a: Box, box_b: Box, margin: float = POSITION_THRESHOLD) -> frozenset[str]:
    """Where A lies relative to B: a subset of ``RELATIONS`` (image y grows downward).

    The centre offset is shrunk per axis by ``margin`` times the summed box sizes, so
    overlapping or nearly aligned objects hold no relation on that axis. The shrunk
    offset over the original offset's length grants each relation whose component
    exceeds 0.5 (about 60 degrees either side of that axis), so a diagonal can grant two.
    """
    a, b = np.asarray(box_a, dtype=float), np.asarray(box_b, dtype=float)
    offset = (a[:2] + a[2:]) / 2 - (b[:2] + b[2:]) / 2
    size = np.abs(a[2:] - a[:2]) + np.abs(b[2:] - b[:2])
    revised = np.maximum(np.abs(offset) - margin * size, 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return frozenset()
    dx, dy = revised / np.linalg.norm(offset)
    found = set()
    if dx < -0.5:
        found.add("left of")
    if dx > 0.5:
        found.add("right of")
    if dy < -0.5:
        found.add("above")
    if dy > 0.5:
        found.add("below")
    return frozenset(found)


def is_geneval_metadata(metadata: Mapping[str, Any] | None) -> bool:
    """Whether a sample carries GenEval metadata (else the reward is NaN for it)."""
    return isinstance(metadata, Mapping) and "include" in metadata


def confidence_threshold(
    metadata: Mapping[str, Any],
    threshold: float = THRESHOLD,
    counting_threshold: float = COUNTING_THRESHOLD,
) -> float:
    """GenEval keeps only confident detections on counting prompts, to not over-count."""
    return counting_threshold if metadata.get("tag") == "counting" else threshold


def color_classes(metadata: Mapping[str, Any]) -> set[str]:
    """Classes whose objects need a color: the color model runs only for these."""
    return {entry["class"] for entry in metadata.get("include", ()) if "color" in entry}


def validate_metadata(metadata: Mapping[str, Any]) -> None:
    """Raise ValueError on malformed GenEval metadata instead of scoring it as a miss."""
    includes = metadata.get("include")
    if not isinstance(includes, Sequence) or isinstance(includes, str):
        raise ValueError(f"GenEval metadata: 'include' must be a list, got {includes!r}")
    for key in ("include", "exclude"):
        for i, entry in enumerate(metadata.get(key) or ()):
            where = f"GenEval metadata {key}[{i}]"
            if not isinstance(entry, Mapping) or not isinstance(entry.get("class"), str):
                raise ValueError(f"{where}: expected a mapping with a string 'class': {entry!r}")
            count = entry.get("count", 1 if key == "include" else None)
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ValueError(f"{where}: 'count' must be an integer >= 1, got {count!r}")
            if key == "exclude":
                continue
            if "color" in entry and entry["color"] not in COLORS:
                raise ValueError(f"{where}: unknown color {entry['color']!r}; known: {COLORS}")
            if "position" in entry:
                position = entry["position"]
                if (
                    not isinstance(position, Sequence)
                    or len(position) != 2
                    or position[0] not in RELATIONS
                    or not isinstance(position[1], int)
                    or not 0 <= position[1] < i
                ):
                    raise ValueError(
                        f"{where}: 'position' must be [relation, index of an earlier include "
                        f"entry] with relation in {RELATIONS}, got {position!r}"
                    )


def _count(entry: Mapping[str, Any]) -> int:
    return int(entry.get("count", 1))


def _color(det: Detection) -> str:
    if det.color is None:
        raise ValueError(f"detection of {det.label!r} has no color; classify colors first")
    return det.color


def _holds(
    found: Sequence[Detection], targets: Sequence[Detection], relation: str, margin: float
) -> bool:
    return all(relation in relations(d.box, t.box, margin) for d in found for t in targets)


def strict_correct(
    objects: Objects, metadata: Mapping[str, Any], position_threshold: float = POSITION_THRESHOLD
) -> bool:
    """GenEval's accuracy of one image: every include clause holds and no exclude does.

    An include clause looks at the ``count`` most confident objects of its class (more
    found is fine); with a color, all of them must have it; with a position, all of
    them must hold the relation to every object of the target clause, which must itself
    have held.
    """
    groups: list[Sequence[Detection] | None] = []
    correct = True
    for entry in metadata["include"]:
        count = _count(entry)
        found = list(objects.get(entry["class"], ()))[:count]
        matched = len(found) >= count
        if matched and "color" in entry:
            matched = sum(_color(d) == entry["color"] for d in found) >= count
        if matched and "position" in entry:
            relation, target = entry["position"]
            targets = groups[target]
            matched = targets is not None and _holds(found, targets, relation, position_threshold)
        groups.append(found if matched else None)
        correct = correct and matched
    for entry in metadata.get("exclude") or ():
        if len(objects.get(entry["class"], ())) >= _count(entry):
            correct = False
    return correct


def partial_terms(
    objects: Objects, metadata: Mapping[str, Any], position_threshold: float = POSITION_THRESHOLD
) -> list[float]:
    """The per-clause terms whose mean is ``partial_score`` (exclude clauses play no part).

    Per include clause: a count term over all kept objects of the class; when the count
    is not exact, a clause with a color or position adds one 0.0 and stops. Otherwise a
    color term (share of the asked count having the color), then, if the color was
    exact, a position term: 1.0 if the relation holds to every object of the target
    clause, 0.0 if it fails or the target clause did not match exactly.
    """
    terms: list[float] = []
    groups: list[Sequence[Detection] | None] = []
    for entry in metadata["include"]:
        count = _count(entry)
        found = list(objects.get(entry["class"], ()))
        terms.append(1 - abs(count - len(found)) / count)
        matched = len(found) == count
        if not matched:
            if "color" in entry or "position" in entry:
                terms.append(0.0)
        else:
            if "color" in entry:
                right = sum(_color(d) == entry["color"] for d in found)
                terms.append(1 - abs(count - right) / count)
                matched = right == count
            if matched and "position" in entry:
                relation, target = entry["position"]
                targets = groups[target]
                matched = targets is not None and _holds(
                    found, targets, relation, position_threshold
                )
                terms.append(1.0 if matched else 0.0)
        groups.append(found if matched else None)
    return terms


def partial_score(
    objects: Objects, metadata: Mapping[str, Any], position_threshold: float = POSITION_THRESHOLD
) -> float:
    """Flow-GRPO's graded GenEval reward: mean of ``partial_terms``, clamped to [0, 1]."""
    terms = partial_terms(objects, metadata, position_threshold)
    return min(max(math.fsum(terms) / len(terms), 0.0), 1.0) if terms else 0.0


def object_crop(image: np.ndarray, det: Detection) -> np.ndarray:
    """The object cut out for color classification: [H, W, 3] uint8 over grey, box-cropped.

    Pixels outside the instance mask are replaced by ``CROP_BACKGROUND`` so the color
    model judges the object, not its surroundings.
    """
    if det.mask is not None:
        if det.mask.shape != image.shape[:2]:
            raise ValueError(f"mask shape {det.mask.shape} != image shape {image.shape[:2]}")
        image = np.where(det.mask[..., None], image, np.array(CROP_BACKGROUND, dtype=image.dtype))
    height, width = image.shape[:2]
    x1, y1, x2, y2 = (round(v) for v in det.box)
    x1, x2 = min(max(x1, 0), width - 1), min(max(x2, x1 + 1), width)
    y1, y2 = min(max(y1, 0), height - 1), min(max(y2, y1 + 1), height)
    return np.ascontiguousarray(image[y1:y2, x1:x2])
