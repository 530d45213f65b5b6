"""``grid.png`` of an evaluation: the first images, each captioned with its prompt and scores.

A grid without captions cannot be read against ``samples.jsonl``; with them, a glance
tells which prompt an image answers and how each metric scored it. Tiles are scaled to
one width so that the captions stay legible for tiny (64 px) and large images alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

TILE = 256  # pixels per tile side
FONT_SIZE = 12
LINE = FONT_SIZE + 4  # pixels per caption line
PADDING = 4
GAP = 6  # white pixels between tiles


def save_grid(
    rows: Sequence[Mapping[str, Any]],
    metrics: Sequence[str],
    root: Path,
    target: Path,
    columns: int = 4,
) -> None:
    """Tile the images of ``rows`` (paths relative to ``root``) row by row, captioned."""
    if not rows:
        return
    font = ImageFont.load_default(size=FONT_SIZE)
    captions = [caption_lines(row, metrics, font, TILE - 2 * PADDING) for row in rows]
    band = max(len(lines) for lines in captions) * LINE + 2 * PADDING
    tiles = [
        _tile(Image.open(root / row["image"]).convert("RGB"), lines, font, band)
        for row, lines in zip(rows, captions, strict=True)
    ]
    width, height = tiles[0].size[0] + GAP, tiles[0].size[1] + GAP
    count = len(tiles)
    size = (width * min(columns, count) - GAP, height * -(-count // columns) - GAP)
    grid = Image.new("RGB", size, "white")
    for i, tile in enumerate(tiles):
        grid.paste(tile, ((i % columns) * width, (i // columns) * height))
    grid.save(target)


def caption_lines(
    row: Mapping[str, Any], metrics: Sequence[str], font: Any, width: int
) -> list[str]:
    """The prompt, then one ``metric score`` line per metric, each shortened to fit."""
    lines = [str(row["prompt"]), *(f"{name} {_score(row.get(name))}" for name in metrics)]
    return [fit(line, font, width) for line in lines]


def fit(text: str, font: Any, width: int) -> str:
    """``text``, cut to its longest prefix that fits with ``...`` when wider than ``width``
    pixels. The prefix is found by bisection, since a prefix is never wider than a longer
    one: O(log n) measurements (cutting one character at a time took 34 s for an 8,000
    character prompt)."""
    if font.getlength(text) <= width:
        return text
    fits, wider = 0, len(text)  # text[:fits] + "..." fits (or fits == 0); text[:wider] not
    while wider - fits > 1:
        middle = (fits + wider) // 2
        if font.getlength(text[:middle] + "...") <= width:
            fits = middle
        else:
            wider = middle
    return text[:fits].rstrip() + "..."


def _score(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3g}"


def _tile(image: Image.Image, lines: Sequence[str], font: Any, band: int) -> Image.Image:
    """The image scaled to ``TILE`` wide over a white band holding its caption."""
    height = round(image.height * TILE / image.width)
    tile = Image.new("RGB", (TILE, height + band), "white")
    # Upscaled pixels stay sharp squares (nothing invented); downscaling is antialiased.
    method = Image.Resampling.NEAREST if image.width < TILE else Image.Resampling.LANCZOS
    tile.paste(image.resize((TILE, height), method), (0, 0))
    draw = ImageDraw.Draw(tile)
    for number, line in enumerate(lines):
        draw.text((PADDING, height + PADDING + number * LINE), line, fill="black", font=font)
    return tile
