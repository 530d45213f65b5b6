"""Images on the wire: PNG for our protocol and VLM judges, JPEG for the pickle protocols.

Every protocol sends the trainer's float images rounded to 8 bits (``to_uint8_images``).
PNG is lossless from there: a reward served by ``serve-reward`` gets exactly those 8-bit
pixels, so one that reads 8-bit pixels (JPEG size, OCR, color rules) scores as in process,
while one that reads float pixels (a learned model's preprocessing) sees the rounded image
and scores differently by that round-off. The pickle protocols send JPEG because their
servers (Flow-GRPO's reward-server, VeRL-Omni's scorers) open the images as JPEG, at PIL's
default quality as Flow-GRPO's client sends them, so scores match the reference's.
"""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image


def png_bytes(image: np.ndarray, size: int | None = None) -> bytes:
    """An [H, W, 3] uint8 image as PNG, resized to ``size`` x ``size`` when given."""
    picture = Image.fromarray(image)
    if size is not None:
        picture = picture.resize((size, size), Image.Resampling.BICUBIC)
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue()


def png_base64(image: np.ndarray, size: int | None = None) -> str:
    """``png_bytes`` as base64 text, for JSON bodies."""
    return base64.b64encode(png_bytes(image, size)).decode("ascii")


def jpeg_bytes(image: np.ndarray) -> bytes:
    """An [H, W, 3] uint8 image as JPEG at PIL's default quality, as the references send."""
    buffer = io.BytesIO()
    Image.fromarray(image).convert("RGB").save(buffer, format="JPEG")
    return buffer.getvalue()


def decode_png_base64(text: str) -> np.ndarray:
    """Base64 PNG text -> [H, W, 3] uint8; ValueError when it is not one."""
    try:
        data = base64.b64decode(text, validate=True)
        with Image.open(io.BytesIO(data), formats=["PNG"]) as picture:
            return np.asarray(picture.convert("RGB"))
    except (ValueError, OSError) as error:  # binascii.Error is a ValueError
        raise ValueError(f"not a base64 PNG image ({type(error).__name__}: {error})") from None
