"""The miniature's object detector: colored shapes found by rule, the GenEval detector analogue.

GenEval runs Mask2Former and a CLIP color classifier; the miniature world has five
flat colors and three shapes, so a few lines of numpy do both jobs and the GenEval
rules (``rewards.geneval_rules``) run unchanged on the result:

1. Background: the median color of the border pixels.
2. Color: every pixel is explained as a blend ``background + alpha * (color -
   background)`` of the background with each palette color of ``world.COLORS``; the
   color whose blend line passes closest wins if that distance is below
   ``max_residual`` and the pixel is mostly object (``alpha >= min_alpha``) and far
   enough from the background (``tolerance``). Unmixing against the background, rather
   than taking the nearest palette color, keeps blurred edges with their own object: a
   half-covered edge pixel of a blue square on white is nearer purple than blue, but it
   lies on the white-blue line. White sign, black ink and in-between colors match no
   line and are ignored.
3. Objects: 8-connected components of equally colored pixels (a vectorised union-find
   over the whole batch), dropping those under ``min_area`` pixels of a 64 px image
   (scaled with the resolution). Images larger than ``MAX_SIDE`` are area-downscaled
   first; boxes and masks come back at the input resolution.
4. Shape: the component, cropped to its box and resampled to a 16 x 16 grid, is
   compared (soft IoU) with ideal filled templates of a circle, a square and an
   apex-up triangle, the shapes ``world`` draws, each also blurred (``BLUR_LEVELS``) and
   cut at half coverage like the objects are. ``score`` grows with how well the best
   template fits and how clearly it beats the runner-up: crisp shapes score ~1,
   blurred ones somewhat less, shapeless blobs under GenEval's 0.3 threshold (dropped by
   ``select_objects``).

Where it is fooled (what an RL policy could exploit, or where it errs on honest images):
it sees color blobs, not objects, so two touching shapes of one color are one
(mis-shaped) object and a shape split by a stroke of another color is two; any blob
that fits a template counts, whatever it depicts (a yellow sun is a circle, a sign
painted in a palette color a square); shapes in off-palette colors,
outlines, textured or gradient backgrounds and shapes touching the border (which shift
the background estimate) are missed or misread; rotated squares (diamonds) and
apex-down triangles match no template well. It is a faithful judge of images like the
world's renders, and a rough one of anything else, like GenEval's detector off COCO.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from PIL import Image

from mogradient_diffusion.rewards.geneval_rules import Detection, mask_to_box

from .world import COLORS, SHAPES, SIZE

# Working resolution cap: the cost grows with the pixel count, and every shape the world
# draws keeps > 100 px of area at 128 px.
MAX_SIDE = 128
_GRID = 16  # side of the normalised crop the templates are compared on


def _gaussian_matrix(n: int, sigma: float) -> np.ndarray:
    """[n, n] matrix applying a 1-D Gaussian blur (zero padding) to a length-n signal."""
    t = np.arange(n)
    kernel = np.exp(-((t[:, None] - t[None, :]) ** 2) / (2 * sigma**2))
    return kernel / (sigma * np.sqrt(2 * np.pi))


def _template(shape: str, blur: float, grid: int = _GRID) -> np.ndarray:
    """An ideal filled ``shape`` blurred by ``blur`` x its size, cut at half, on the grid.

    Built like the detector sees an object: the half-coverage mask (``min_alpha``), cropped
    to its box and area-resampled, so a blurred shape is compared with a blurred template.
    """
    side, pad = 64, 32
    centres = (np.arange(side + 2 * pad) + 0.5 - pad) / side
    u, v = np.meshgrid(centres, centres)  # the shape's box is [0, 1]^2, y grows downward
    inside = (u >= 0) & (u <= 1) & (v >= 0) & (v <= 1)
    filled = {
        "circle": (u - 0.5) ** 2 + (v - 0.5) ** 2 <= 0.25,
        "square": inside,
        "triangle": inside & (np.abs(u - 0.5) <= v / 2),  # apex at the top, like world's
    }[shape].astype(np.float64)
    if blur > 0:
        blur_matrix = _gaussian_matrix(filled.shape[0], blur * side)
        filled = blur_matrix @ filled @ blur_matrix.T
    return _normalised_crop(filled >= 0.5, grid)


def _normalised_crop(mask: np.ndarray, grid: int = _GRID) -> np.ndarray:
    """A boolean mask cropped to its box and area-resampled to [grid, grid] floats in [0, 1]."""
    rows, cols = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
    if not rows.size:
        raise ValueError("empty mask")
    crop = mask[rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1]
    pil = Image.fromarray(crop.astype(np.uint8) * 255)
    return np.asarray(pil.resize((grid, grid), Image.Resampling.BOX), dtype=np.float32) / 255


# Blur levels (Gaussian sigma over shape size) the templates cover: PIL's GaussianBlur(1)
# on the world's 10-17 px shapes is 0.06-0.1. Beyond ~0.15 a square's half-coverage mask is
# nearly a circle and a triangle's loses its apex: shapes are no longer told apart.
BLUR_LEVELS = (0.0, 0.05, 0.1, 0.15)
TEMPLATES: dict[str, np.ndarray] = {
    shape: np.stack([_template(shape, blur) for blur in BLUR_LEVELS]) for shape in SHAPES
}


def soft_iou(a: np.ndarray, b: np.ndarray) -> float:
    """IoU of two masks with values in [0, 1] (sum of minima over sum of maxima)."""
    union = np.maximum(a, b).sum()
    return float(np.minimum(a, b).sum() / union) if union > 0 else 0.0


def classify_shape(mask: np.ndarray) -> tuple[str, float, dict[str, float]]:
    """Shape name, confidence in [0, 1] and per-shape template IoU of one boolean mask.

    The mask is cropped to its box and area-resampled to the template grid, so the fit is
    independent of size and position; a shape's IoU is its best over ``BLUR_LEVELS``.
    Confidence is ``fit * separation``: ``fit`` rises from 0 at IoU 0.6 to 1 at IoU 0.8
    with the best shape, ``separation`` from 0 to 1 as its lead over the runner-up grows
    to 0.05 (ideal shapes lead by >= 0.12, the world's smallest pixelated circles by
    0.04; a rounded square halfway to a circle by nothing, so it falls under GenEval's
    0.3 threshold and is not counted as either).
    """
    grid = _normalised_crop(mask)
    ious = {
        name: max(soft_iou(grid, template) for template in templates)
        for name, templates in TEMPLATES.items()
    }
    ranked = sorted(ious.values(), reverse=True)
    best = max(ious, key=ious.__getitem__)
    fit = np.clip((ranked[0] - 0.6) / 0.2, 0.0, 1.0)
    separation = np.clip((ranked[0] - ranked[1]) / 0.05, 0.0, 1.0)
    return best, float(fit * separation), ious


def background_color(images: np.ndarray) -> np.ndarray:
    """Median color of the border pixels of [..., H, W, 3] images: [..., 3] float32, 0..255."""
    x = np.asarray(images, dtype=np.float32)
    border = np.concatenate(
        [x[..., 0, :, :], x[..., -1, :, :], x[..., 1:-1, 0, :], x[..., 1:-1, -1, :]], axis=-2
    )
    return np.median(border, axis=-2)


def color_map(
    images: np.ndarray,
    palette: Mapping[str, tuple[int, int, int]] = COLORS,
    tolerance: float = 40.0,
    max_residual: float = 60.0,
    min_alpha: float = 0.5,
    max_alpha: float = 1.5,
) -> np.ndarray:
    """Per pixel of [B, H, W, 3] images, the index into ``palette`` it shows, or -1.

    See the module doc. Distances are Euclidean in 0..255 RGB; ``max_alpha`` lets darker
    or more saturated versions of a palette color (past it on the blend line) count.
    """
    x = np.asarray(images, dtype=np.float32)
    background = background_color(x)  # [B, 3]
    diff = x - background[:, None, None, :]  # [B, H, W, 3]
    distance2 = (diff**2).sum(axis=-1)
    classes = np.full(distance2.shape, -1, dtype=np.int64)
    where = np.nonzero(distance2 > tolerance**2)  # only foreground pixels go further
    if not where[0].size:
        return classes
    colors = np.array(list(palette.values()), dtype=np.float32)
    colors = colors[None] - background[:, None, :]  # [B, K, 3]
    lengths = (colors**2).sum(axis=-1)  # [B, K]
    pixel_colors, pixel_lengths = colors[where[0]], lengths[where[0]]  # [N, K, 3], [N, K]
    dot = np.einsum("nc,nkc->nk", diff[where], pixel_colors)
    alpha = np.clip(dot / np.maximum(pixel_lengths, 1e-6), 0.0, max_alpha)
    # |diff - alpha * color|^2, expanded so no [N, K, 3] difference is materialised
    residual2 = distance2[where][:, None] - 2 * alpha * dot + alpha**2 * pixel_lengths
    # a palette color as close as the background is invisible on it
    residual2 = np.where(pixel_lengths > tolerance**2, residual2, np.inf)
    index = residual2.argmin(axis=-1)
    rows = np.arange(index.size)
    ok = (residual2[rows, index] <= max_residual**2) & (alpha[rows, index] >= min_alpha)
    classes[where] = np.where(ok, index, -1)
    return classes


def component_labels(classes: np.ndarray) -> np.ndarray:
    """8-connected components of equal non-negative values in [B, H, W] class maps.

    Returns labels of the same shape: -1 where ``classes`` is -1, else the flat index
    (into the whole batch) of one pixel of the component, the same for all its pixels.
    Vectorised union-find over the edges between equal neighbours: each round hooks every
    root onto the smallest root it touches, then pointer jumping flattens the trees; a
    handful of rounds label a whole batch at once.
    """
    valid = classes >= 0
    pixels = np.flatnonzero(valid)
    compact = np.full(classes.shape, -1, dtype=np.int64)
    compact[valid] = np.arange(pixels.size)
    height, width = classes.shape[1:]
    sources, targets = [], []
    for dy, dx in ((0, 1), (1, 0), (1, 1), (1, -1)):  # each neighbour pair once
        x0, x1 = max(0, -dx), width - max(0, dx)
        here = (slice(None), slice(0, height - dy), slice(x0, x1))
        there = (slice(None), slice(dy, height), slice(x0 + dx, x1 + dx))
        linked = valid[here] & (classes[here] == classes[there])
        sources.append(compact[here][linked])
        targets.append(compact[there][linked])
    source, target = np.concatenate(sources), np.concatenate(targets)
    parent = np.arange(pixels.size)
    while True:
        a, b = parent[source], parent[target]
        differ = a != b
        if not differ.any():
            break
        np.minimum.at(parent, np.maximum(a, b)[differ], np.minimum(a, b)[differ])
        while True:
            jumped = parent[parent]
            if np.array_equal(jumped, parent):
                break
            parent = jumped
    labels = np.full(classes.shape, -1, dtype=np.int64)
    labels[valid] = pixels[parent]
    return labels


def detect_shapes_batch(
    images: np.ndarray,
    tolerance: float = 40.0,
    max_residual: float = 60.0,
    min_alpha: float = 0.5,
    min_area: float = 12.0,
    palette: Mapping[str, tuple[int, int, int]] = COLORS,
) -> list[list[Detection]]:
    """``detect_shapes`` on every image of a [B, H, W, 3] uint8 batch (labelled together)."""
    images = np.asarray(images)
    if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != np.uint8:
        raise ValueError(f"expected [B, H, W, 3] uint8 images, got {images.dtype} {images.shape}")
    batch, height, width = images.shape[:3]
    if batch == 0:
        return []
    scale = min(1.0, MAX_SIDE / max(height, width))
    if scale < 1:
        size = (max(1, round(width * scale)), max(1, round(height * scale)))
        work = np.stack(
            [np.asarray(Image.fromarray(im).resize(size, Image.Resampling.BOX)) for im in images]
        )
    else:
        work = images
    h, w = work.shape[1:3]
    names = list(palette)
    classes = color_map(work, palette, tolerance, max_residual, min_alpha)
    labels = component_labels(classes)
    roots, counts = np.unique(labels[labels >= 0], return_counts=True)
    area_floor = min_area * (h * w) / (SIZE * SIZE)
    detections: list[list[Detection]] = [[] for _ in range(batch)]
    for root, count in zip(roots.tolist(), counts.tolist(), strict=True):
        if count < area_floor:
            continue
        b = root // (h * w)
        mask = labels[b] == root
        label, score, _ = classify_shape(mask)
        color = names[int(classes.flat[root])]
        if scale < 1:
            mask = (
                np.asarray(
                    Image.fromarray(mask.astype(np.uint8) * 255).resize(
                        (width, height), Image.Resampling.NEAREST
                    )
                )
                > 127
            )
            if not mask.any():
                continue
        detections[b].append(Detection(label, score, mask_to_box(mask), mask, color))
    return detections


def detect_shapes(
    image: np.ndarray,
    tolerance: float = 40.0,
    max_residual: float = 60.0,
    min_alpha: float = 0.5,
    min_area: float = 12.0,
    palette: Mapping[str, tuple[int, int, int]] = COLORS,
) -> list[Detection]:
    """Colored shapes in one [H, W, 3] uint8 image: label = shape, color = color name.

    ``tolerance``: least distance from the background (0..255 RGB); ``max_residual``:
    most distance from a color's blend line; ``min_alpha``: least share of a pixel the
    object must cover; ``min_area``: least object area in pixels of a 64 px image. The
    detections are unfiltered: ``geneval_rules.select_objects`` applies the threshold.
    """
    return detect_shapes_batch(
        np.asarray(image)[None], tolerance, max_residual, min_alpha, min_area, palette
    )[0]
