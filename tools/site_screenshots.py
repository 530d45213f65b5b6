"""Screenshots of the built documentation site in a headless browser, for review.

    .venv/bin/python tools/site_screenshots.py --out docs/screenshots

Builds the site (strict) into a temporary folder and photographs three pages with
Chromium (``apt-get install chromium``): the home page, the miniature's head-to-head with
its figure, and the MGDA reference. Chromium's screenshots cannot scroll to an anchor, so a
tall page is photographed whole and cut at its heading, found by Tesseract. The PNGs are
reduced to 256 colours to keep the repository small.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import pytesseract
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
WIDTH, HEIGHT = 1280, 1600
# (file name, page, the heading's words to cut at; None: the top of the page)
SHOTS = (
    ("home.png", "index.html", None),
    ("miniature_results.png", "miniature/index.html", ("The", "head-to-head")),
    ("mgda_reference.png", "reference/core/harmonizers/index.html", ("class", "MGDA")),
)


def build_site(site: Path) -> None:
    environment = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)]
    subprocess.run(command, cwd=ROOT, check=True, env=environment, capture_output=True)


def photograph(page: Path, height: int, out: Path) -> Image.Image:
    """The page's top ``height`` pixels at the site's desktop width."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise SystemExit("needs Chromium on PATH (apt-get install chromium)")
    subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--virtual-time-budget=4000",
            f"--window-size={WIDTH},{height}",
            f"--screenshot={out}",
            page.as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return Image.open(out)


def heading_top(image: Image.Image, words: tuple[str, str]) -> int:
    """The y of the first line of the main column that reads ``words`` (Tesseract)."""
    column = image.crop((280, 0, 1000, image.height)).convert("L")
    data = pytesseract.image_to_data(column, output_type=pytesseract.Output.DICT)
    text = data["text"]
    for index in range(len(text) - 1):
        if (text[index], text[index + 1]) == words and data["height"][index] >= 16:
            return data["top"][index]
    raise SystemExit(f"heading {' '.join(words)!r} not found on the page")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshots")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as temporary:
        site = Path(temporary) / "site"
        build_site(site)
        for name, page, heading in SHOTS:
            raw = Path(temporary) / name
            if heading is None:
                shot = photograph(site / page, HEIGHT, raw)
            else:
                tall = photograph(site / page, 16 * HEIGHT, raw)
                top = max(0, heading_top(tall, heading) - 60)
                shot = tall.crop((0, top, WIDTH, top + HEIGHT))
            shot.convert("RGB").quantize(256).save(args.out / name, optimize=True)
            print(args.out / name)


if __name__ == "__main__":
    main()
