"""Our protocol: JSON over HTTP, what ``serve-reward`` speaks. Safe by construction (JSON
decodes to plain data), versioned, and lossless (PNG).

- ``POST {url}/score`` with ``{"version": 1, "images": [base64 PNG], "prompts": [...],
  "metadata": [{...}] or null}``, answered by ``{"version": 1, "scores": [number or
  null], "details": [...]}``; null is "not applicable" (NaN), ``details`` (optional,
  one entry per image) is for extras beside the score, unread by this client.
- ``GET {url}/health`` answers ``{"status": "ok", "rewards": [name]}``.
- Errors are answered with a 4xx (a bad request) or 500 (the reward raised) and
  ``{"error": "one line"}``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..base import Metadata
from .images import png_base64
from .protocol import BadResponse, Protocol, one_line, quote, score_value

VERSION = 1


class Ours(Protocol):
    """JSON + PNG to ``{url}/score``; several images per request."""

    name = "ours"
    content_type = "application/json"
    default_batch_size = 16

    def endpoint(self, url: str) -> str:
        return url.rstrip("/") + "/score"

    def encode(self, images: np.ndarray, prompts: list[str], metadata: Metadata | None) -> bytes:
        body = {
            "version": VERSION,
            "images": [png_base64(image) for image in images],
            "prompts": prompts,
            "metadata": None if metadata is None else [dict(item) for item in metadata],
        }
        try:
            return json.dumps(body).encode("utf-8")
        except (TypeError, ValueError) as error:  # the caller's metadata, not the server
            raise ValueError(f"the metadata cannot be sent as JSON: {error}") from None

    def decode(self, body: bytes, source: str) -> Sequence[float | None]:
        try:
            answer = json.loads(body)
        except ValueError:
            text = one_line(body.decode("utf-8", "replace"))
            raise BadResponse(f"the answer is not JSON: {text!r}") from None
        if not isinstance(answer, dict) or answer.get("version") != VERSION:
            raise BadResponse(f"the answer is not a version {VERSION} answer: {_short(answer)}")
        scores = answer.get("scores")
        if not isinstance(scores, list):
            raise BadResponse(f"the answer has no list of scores: {_short(answer)}")
        return [None if score is None else score_value(score, "a score") for score in scores]

    def error_detail(self, body: bytes, source: str) -> str:
        try:
            answer = json.loads(body)
        except ValueError:
            return super().error_detail(body, source)
        if isinstance(answer, dict) and "error" in answer:
            return one_line(str(answer["error"]))
        return super().error_detail(body, source)


def _short(value: Any) -> str:
    return quote(json.dumps(value))
