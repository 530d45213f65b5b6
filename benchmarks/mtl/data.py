"""Three multi-task problems built from scikit-learn's bundled 8x8 digits (nothing downloaded).

The 1797 digits are split once (a fixed permutation) into train/validation/test pools
before any composite is made, so no digit image appears in two splits. Everything is
generated from a seed with a private generator: the same seed gives the same tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CANVAS = 14
DIGIT = 8
POOL_FRACTIONS = (0.6, 0.2)  # train, validation; the rest is test
SPLIT_SEED = 0


@dataclass(frozen=True)
class Task:
    """One head: its loss (``ce``, ``bce`` or ``mse``), output width and test metric."""

    name: str
    loss: str
    outputs: int
    metric: str
    higher_is_better: bool


@dataclass(frozen=True)
class Split:
    images: torch.Tensor  # N x 1 x CANVAS x CANVAS, float32 in [0, 1]
    targets: tuple[torch.Tensor, ...]  # one per task


@dataclass(frozen=True)
class Problem:
    name: str
    tasks: tuple[Task, ...]
    train: Split
    validation: Split
    test: Split


def _digit_pools() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(images in [0, 1], labels) for the train, validation and test pools of base digits."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(SPLIT_SEED))
    first = int(POOL_FRACTIONS[0] * len(order))
    second = first + int(POOL_FRACTIONS[1] * len(order))
    return [
        (images[order[part]], labels[order[part]])
        for part in (slice(0, first), slice(first, second), slice(second, None))
    ]


def _paste(canvas: torch.Tensor, digits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor):
    """Overlay each digit on its canvas at (row, col) by pixel-wise max (ink does not add up)."""
    for index in range(len(canvas)):
        row, col = int(rows[index]), int(cols[index])
        window = canvas[index, row : row + DIGIT, col : col + DIGIT]
        torch.maximum(window, digits[index], out=window)


def _offsets(count: int, low: int, high: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(low, high + 1, (2, count), generator=generator)


MULTI_TASKS = (
    Task("upper-left digit", "ce", 10, "accuracy", True),
    Task("lower-right digit", "ce", 10, "accuracy", True),
)


def multi_digits(sizes: tuple[int, int, int], seed: int = 0) -> Problem:
    """MultiMNIST (Sener & Koltun 2018) in miniature: two overlapping digits on a 14x14 canvas.

    The upper-left digit sits at a random offset in [0, 2]^2, the lower-right one in
    [4, 6]^2, so they overlap by 2 to 6 pixels each way; each task reads one of them.
    """
    splits = [
        Split(pair.canvas, (pair.labels[pair.first], pair.labels[pair.second]))
        for pair in _digit_pairs(sizes, seed)
    ]
    return Problem("multi-digits", MULTI_TASKS, *splits)


@dataclass(frozen=True)
class _DigitPair:
    """One split's two-digit canvases and which pool digits (``first``, ``second``) they hold."""

    canvas: torch.Tensor  # N x 1 x CANVAS x CANVAS
    images: torch.Tensor  # the pool's digit images
    labels: torch.Tensor  # the pool's labels
    first: torch.Tensor  # upper-left digit of each canvas (pool indices)
    second: torch.Tensor  # lower-right digit


def _digit_pairs(sizes: tuple[int, int, int], seed: int) -> list[_DigitPair]:
    """Train, validation and test canvases of two overlapping digits, one at an offset in
    [0, 2]^2 and one in [4, 6]^2: what multi_digits and many_tasks share."""
    generator = torch.Generator().manual_seed(seed)
    pairs = []
    for (images, labels), count in zip(_digit_pools(), sizes, strict=True):
        first = torch.randint(len(labels), (count,), generator=generator)
        second = torch.randint(len(labels), (count,), generator=generator)
        canvas = torch.zeros(count, CANVAS, CANVAS)
        _paste(canvas, images[first], *_offsets(count, 0, 2, generator))
        _paste(canvas, images[second], *_offsets(count, 4, 6, generator))
        pairs.append(_DigitPair(canvas.unsqueeze(1), images, labels, first, second))
    return pairs


INK_SCALE = 16.0  # the target is ink in raw load_digits units (0..16 per pixel), ~300 per digit

SCALE_TASKS = (
    Task("class", "ce", 10, "accuracy", True),
    Task("parity", "bce", 1, "accuracy", True),
    Task("ink", "mse", 1, "MAE", False),
)


def scaled_tasks(sizes: tuple[int, int, int], seed: int = 0) -> Problem:
    """One digit at a random offset in [0, 6]^2 with three tasks whose losses differ ~1e4-fold.

    Class (cross-entropy, ~2.3 at start), parity (BCE, ~0.7) and total ink in raw
    ``load_digits`` units (MSE on an unnormalized target of ~300 +- 70, ~1e5 at start).
    Parity agrees with class, ink is a nuisance-scale regression: with equal weights its
    gradient swamps the shared trunk, so how a method normalizes decides the outcome.
    """
    generator = torch.Generator().manual_seed(seed)
    splits = []
    for (images, labels), count in zip(_digit_pools(), sizes, strict=True):
        chosen = torch.randint(len(labels), (count,), generator=generator)
        canvas = torch.zeros(count, CANVAS, CANVAS)
        _paste(canvas, images[chosen], *_offsets(count, 0, CANVAS - DIGIT, generator))
        digit = labels[chosen]
        ink = images[chosen].sum(dim=(1, 2)) * INK_SCALE
        splits.append(Split(canvas.unsqueeze(1), (digit, (digit % 2).float(), ink)))
    return Problem("scaled-tasks", SCALE_TASKS, *splits)


MANY_TASKS = (
    Task("upper-left digit", "ce", 10, "accuracy", True),
    Task("lower-right digit", "ce", 10, "accuracy", True),
    Task("upper-left parity", "bce", 1, "accuracy", True),
    Task("lower-right parity", "bce", 1, "accuracy", True),
    Task("upper-left >= 5", "bce", 1, "accuracy", True),
    Task("lower-right >= 5", "bce", 1, "accuracy", True),
    Task("upper-left > lower-right", "bce", 1, "accuracy", True),
    Task("same parity", "bce", 1, "accuracy", True),
    Task("digit sum", "mse", 1, "MAE", False),
    Task("digit product / 81", "mse", 1, "MAE", False),
    Task("upper-left ink", "mse", 1, "MAE", False),
    Task("lower-right ink / 1000", "mse", 1, "MAE", False),
)


def many_tasks(sizes: tuple[int, int, int], seed: int = 0) -> Problem:
    """Twelve tasks on the two overlapping digits of ``multi_digits``, for a 64-wide trunk.

    Easy and hard (parity vs comparing the two digits, or the XOR of their parities),
    one digit or both, and losses from ~0.01 (product / 81, ink / 1000) through ~1
    (cross-entropy, BCE) and ~1e2 (digit sum) to ~1e5 (ink in raw units) at the start:
    many objectives competing for little capacity at scales four orders of magnitude
    apart, where how a method weighs them should show beyond seed noise.
    """
    splits = []
    for pair in _digit_pairs(sizes, seed):
        upper, lower = pair.labels[pair.first], pair.labels[pair.second]
        ink = pair.images.sum(dim=(1, 2)) * INK_SCALE
        targets = (
            upper,
            lower,
            (upper % 2).float(),
            (lower % 2).float(),
            (upper >= 5).float(),
            (lower >= 5).float(),
            (upper > lower).float(),
            (upper % 2 == lower % 2).float(),
            (upper + lower).float(),
            (upper * lower).float() / 81.0,
            ink[pair.first],
            ink[pair.second] / 1000.0,
        )
        splits.append(Split(pair.canvas, targets))
    return Problem("many-tasks", MANY_TASKS, *splits)


PROBLEMS = {"multi-digits": multi_digits, "scaled-tasks": scaled_tasks, "many-tasks": many_tasks}
