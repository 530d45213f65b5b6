"""A vision-language judge behind an OpenAI-compatible chat-completions API (vLLM, SGLang).

One request per image: ``POST {url}/chat/completions`` with the model, temperature 0 and
one user message holding the image (a PNG data URL) and the question, the prompt template
with ``{prompt}`` replaced by the image's prompt. The reply's score is the first match of
``score_pattern``'s group (default: the number after ``Final Score:``); it must lie in
``score_range`` (default [1, 5]), and is mapped to [0, 1] as ``(x - low) / (high - low)``.
That mapping puts the judge's whole scale on [0, 1], as VeRL-Omni does for UnifiedReward
2.0 (the ``unified_reward`` reward keeps Flow-GRPO's ``x / 5`` for parity with it); both
are affine, so group-normalized advantages are the same under either. A reply without a
score in range fails that image: it is never scored 0.

The API key comes from an environment variable (``api_key_env``), read per request: reward
options are written to the run's config.yaml, checkpoints and eval summaries, so a literal
``api_key`` option is refused (as ``unified_reward`` does).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..base import Metadata
from ..unified_reward import DEFAULT_QUESTION, ENV_NAME
from .images import png_base64
from .protocol import BadResponse, Protocol, quote

DEFAULT_PATTERN = r"Final Score:\s*([0-9]+(?:\.[0-9]+)?)"


class OpenAiJudge(Protocol):
    """Chat completions with one image each; scores in [0, 1]."""

    name = "openai_judge"
    content_type = "application/json"
    images_per_request = 1
    value_range = (0.0, 1.0)

    def __init__(
        self,
        model: str | None = None,
        api_key: str | None = None,
        api_key_env: str | None = None,
        prompt_template: str = DEFAULT_QUESTION,
        score_pattern: str = DEFAULT_PATTERN,
        score_range: Sequence[float] = (1.0, 5.0),
        image_size: int | None = None,
    ):
        if api_key is not None:
            raise ValueError(
                "the api_key option is refused: options are saved to disk in clear text; "
                "put the key in an environment variable and name it with api_key_env"
            )
        if not (isinstance(model, str) and model):
            raise ValueError(
                "protocol openai_judge needs the option model: the name the server serves "
                "the judge under (vLLM's --served-model-name)"
            )
        if api_key_env is not None:
            if not (isinstance(api_key_env, str) and ENV_NAME.fullmatch(api_key_env)):
                raise ValueError("api_key_env must name an environment variable, not hold the key")
            if not os.environ.get(api_key_env):
                raise ValueError(f"api_key_env names {api_key_env}, which is not set")
        if not isinstance(prompt_template, str) or "{prompt}" not in prompt_template:
            raise ValueError("prompt_template must contain the placeholder {prompt}")
        try:
            pattern = re.compile(score_pattern)
        except (re.error, TypeError) as error:
            raise ValueError(f"score_pattern {score_pattern!r} is not a regex: {error}") from None
        if pattern.groups < 1:
            raise ValueError(f"score_pattern {score_pattern!r} needs a group around the number")
        low, high = _range(score_range)
        if image_size is not None and not (isinstance(image_size, int) and image_size >= 1):
            raise ValueError(f"image_size must be a positive number of pixels, got {image_size!r}")
        self.model = model
        self.api_key_env = api_key_env
        self.prompt_template = prompt_template
        self.pattern = pattern
        self.low, self.high = low, high
        self.image_size = image_size

    def endpoint(self, url: str) -> str:
        return url.rstrip("/") + "/chat/completions"

    def headers(self) -> dict[str, str]:
        headers = super().headers()
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        if key:  # never kept on self: see the module docstring
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def encode(self, images: np.ndarray, prompts: list[str], metadata: Metadata | None) -> bytes:
        # replace, not str.format: a template may hold other braces (a JSON example)
        question = self.prompt_template.replace("{prompt}", prompts[0])
        image_url = "data:image/png;base64," + png_base64(images[0], self.image_size)
        content = [
            {"type": "image_url", "image_url": {"url": image_url}},
            {"type": "text", "text": question},
        ]
        body = {
            "model": self.model,
            "temperature": 0,
            "messages": [{"role": "user", "content": content}],
        }
        return json.dumps(body).encode("utf-8")

    def decode(self, body: bytes, source: str) -> Sequence[float | None]:
        try:
            reply = json.loads(body)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            text = quote(body.decode("utf-8", "replace"))
            raise BadResponse(f"the answer is not a chat completion: {text!r}") from None
        if not isinstance(reply, str):
            raise BadResponse(f"the reply's content is not text: {quote(repr(reply))}")
        match = self.pattern.search(reply)
        try:
            raw = float(match.group(1)) if match else math.nan
        except (TypeError, ValueError):
            raw = math.nan
        if not self.low <= raw <= self.high:
            raise BadResponse(
                f"no score in [{self.low:g}, {self.high:g}] matching {self.pattern.pattern!r} "
                f"in the reply {quote(reply)!r}"
            )
        return [(raw - self.low) / (self.high - self.low)]


def _range(value: Any) -> tuple[float, float]:
    """``score_range``: two numbers, low < high."""
    if isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 2:
        low, high = value
        if (
            all(isinstance(x, (int, float)) and math.isfinite(x) for x in (low, high))
            and low < high
        ):
            return float(low), float(high)
    raise ValueError(f"score_range must be [low, high] with low < high, got {value!r}")
