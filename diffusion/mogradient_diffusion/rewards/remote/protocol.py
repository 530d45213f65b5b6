"""What every wire protocol provides: how one request is written and its answer read.

The client (``client.py``) owns the transport (the HTTP connection pool, retries, time
limits, the failure policy); a protocol is only the format, so that each reference
server's quirks live in one small class and the failure handling is the same for all.
"""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from ..base import Metadata
from .safe_pickle import UnsafePickleError, safe_loads

QUOTE_CHARS = 200


class BadResponse(ValueError):
    """A server answered (2xx) but not as its protocol says: not retried, the same request
    would get the same answer."""


class Protocol(ABC):
    """One wire format. ``images_per_request``: the fixed number of images each request
    carries (1 for one-sample protocols), or None for any (the client's ``batch_size``,
    ``default_batch_size`` unless set). ``value_range``: the scores' range when the
    protocol fixes it (a judge's scale mapped to [0, 1]), else unbounded."""

    name: ClassVar[str]
    content_type: ClassVar[str]
    images_per_request: ClassVar[int | None] = None
    default_batch_size: ClassVar[int] = 1
    value_range: ClassVar[tuple[float, float]] = (-math.inf, math.inf)

    def endpoint(self, url: str) -> str:
        """The URL requests are POSTed to, given the ``url`` option."""
        return url

    def headers(self) -> dict[str, str]:
        return {"Content-Type": self.content_type}

    @abstractmethod
    def encode(self, images: np.ndarray, prompts: list[str], metadata: Metadata | None) -> bytes:
        """The body of one request: ``images`` [b, H, W, 3] uint8 with their prompts."""

    @abstractmethod
    def decode(self, body: bytes, source: str) -> Sequence[float | None]:
        """The scores in a 2xx answer (None: not applicable); ``BadResponse`` (or
        ``UnsafePickleError``) when it is not a valid answer. ``source`` names the server."""

    def error_detail(self, body: bytes, source: str) -> str:
        """One line about an error answer (4xx, 5xx), for the failure message."""
        return one_line(body.decode("utf-8", "replace")) or "(empty body)"


class PickleProtocol(Protocol):
    """The protocols of Flow-GRPO's reward-server and its descendants: pickled dicts, read
    back with the restricted unpickler (``safe_pickle.py``)."""

    content_type = "application/octet-stream"

    def load(self, body: bytes, source: str) -> dict[str, Any]:
        """The answer's dict; BadResponse when it is not a pickled dict."""
        try:
            data = safe_loads(body, source)
        except UnsafePickleError:
            raise
        except Exception as error:  # any failure of an untrusted body is a bad answer
            text = one_line(body.decode("utf-8", "replace"))
            kind = type(error).__name__
            raise BadResponse(f"the answer is not a pickle ({kind}): {text!r}") from None
        if not isinstance(data, dict):
            raise BadResponse(f"the answer is a pickled {type(data).__name__}, not a dict")
        return data

    def error_detail(self, body: bytes, source: str) -> str:
        """``{"error": traceback}`` pickled (deepgen_rl's services), else the body as text
        (reward-server sends the traceback's text)."""
        try:
            data = safe_loads(body, source)
        except Exception:
            return super().error_detail(body, source)
        if isinstance(data, dict) and "error" in data:
            return one_line(str(data["error"]))
        return super().error_detail(body, source)


def scores_from(values: Any, what: str) -> list[float]:
    """A list (or 1-D array) of real numbers -> floats; BadResponse naming ``what``.
    Booleans are refused (``True`` is no score), as in our protocol's JSON."""
    if isinstance(values, np.ndarray) and values.ndim == 1:
        values = values.tolist()
    if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        raise BadResponse(f"{what} is a {type(values).__name__}, not a list of numbers")
    return [score_value(value, what) for value in values]


def score_value(value: Any, what: str) -> float:
    """One score as a float: a real number, not a bool, within a float's range."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        shown = quote(repr(value)) if not isinstance(value, int) else repr(value)
        raise BadResponse(f"{what}: {shown} is not a number")
    try:
        return float(value)
    except OverflowError:  # an integer past 1.8e308
        bits = value.bit_length() if isinstance(value, int) else "?"
        raise BadResponse(f"{what}: an integer of {bits} bits is too large for a float") from None


def one_line(text: str) -> str:
    """The last non-empty line of ``text`` (a traceback's is the exception), shortened."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return quote(lines[-1]) if lines else ""


def quote(text: str) -> str:
    return text[:QUOTE_CHARS] + ("..." if len(text) > QUOTE_CHARS else "")
