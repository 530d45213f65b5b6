"""UnifiedReward: a vision-language judge, queried over HTTP, scores caption fit and quality.

The model (e.g. ``CodeGoat24/UnifiedReward-qwen-7b``) is too large to share the training
GPU comfortably, so, as in Flow-GRPO, the user serves it behind an OpenAI-compatible
endpoint (vLLM, SGLang) and this reward sends one chat request per image: the image
(resized to 512x512, PNG) and a question asking for a 1-5 score after ``Final Score:``.
The reward is that score divided by 5, the references' scale, so it lies in [0.2, 1].
Unlike the reference, a reply without a parseable score, or a request that keeps
failing, raises [`RewardError`][mogradient_diffusion.rewards.base.RewardError] instead of silently
scoring zero.

The API key comes only from an environment variable (``api_key_env``, read per request):
reward options are recorded in the run's ``config.yaml``, every checkpoint and ``eval``'s
``summary.json``, so a key given as an option would be written to disk in clear text.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from .base import Metadata, Reward, RewardError, to_uint8_images
from .local_weights import MissingWeightsError
from .registry import register_reward

API_KEY_ENV = "UNIFIED_REWARD_API_KEY"
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
HOW_TO_SERVE = (
    "Start an OpenAI-compatible server for it, e.g. "
    "`vllm serve CodeGoat24/UnifiedReward-qwen-7b --port 17140 "
    "--served-model-name UnifiedReward-7b-v1.5`, and set the reward option "
    "`base_url=http://127.0.0.1:17140/v1` (and `model=` to the served model name)."
)
# Our wording of the reference's question; `{prompt}` is replaced by the caption. It is
# what the model reads, so its British "colour" stays: a new wording would change scores.
DEFAULT_QUESTION = (
    "<image>\n"
    "Below are a text caption and an image generated from it. Judge the image on two "
    "criteria:\n"
    "1. Caption alignment: how faithfully the image shows what the caption describes, "
    "including the objects, how they relate to each other and their attributes.\n"
    "2. Image quality: the overall visual quality, including sharpness, preserved detail, "
    "colour accuracy and aesthetic appeal.\n"
    "Weighing both criteria, give a final score from 1 to 5, written after 'Final Score:'.\n"
    "Text Caption: [{prompt}]"
)
SCORE_PATTERN = re.compile(r"Final Score:\s*([1-5](?:\.\d+)?)")
# HTTP statuses worth retrying: the server is busy or briefly failing, not misconfigured.
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
QUOTE_CHARS = 200


def final_score(reply: str) -> float | None:
    """The number after the first ``Final Score:`` in ``reply`` (1-5); None if absent."""
    match = SCORE_PATTERN.search(reply)
    return None if match is None else float(match.group(1))


def png_data_url(image: np.ndarray, size: int) -> str:
    """An [H, W, 3] uint8 image resized to ``size`` x ``size`` as a base64 PNG data URL."""
    pil = Image.fromarray(image).resize((size, size), Image.Resampling.BICUBIC)
    buffer = io.BytesIO()
    pil.save(buffer, format="PNG")
    return "data:image;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _checked_key_variable(name: str, api_key: str | None, api_key_env: str) -> str:
    """``api_key_env`` once checked; a literal ``api_key`` is refused, since reward options
    are written to disk (config.yaml, checkpoints, eval summaries). Neither error quotes
    the values: one of them may be the key itself."""
    valid = isinstance(api_key_env, str) and ENV_NAME.fullmatch(api_key_env) is not None
    variable = api_key_env if valid else API_KEY_ENV
    if api_key is not None:
        raise ValueError(
            f"{name}: the `api_key` option is refused because options are saved to disk in "
            f"clear text; put the key in the environment variable {variable} instead"
        )
    if not valid:
        raise ValueError(
            f"{name}: api_key_env must be the name of an environment variable (letters, "
            f"digits, underscores), e.g. {API_KEY_ENV}, not the key itself"
        )
    return api_key_env


def _quote(text: str) -> str:
    return repr(text[:QUOTE_CHARS] + ("..." if len(text) > QUOTE_CHARS else ""))


@register_reward
class UnifiedReward(Reward):
    """UnifiedReward's 1-5 judgement of caption alignment and image quality, divided by 5.

    Options: ``base_url`` (the server's OpenAI API root, e.g. ``http://host:port/v1``;
    required), ``model`` (served model name), ``api_key_env`` (the environment variable
    whose value, if set, is sent as a Bearer token; default ``UNIFIED_REWARD_API_KEY``;
    a literal ``api_key`` is refused, see the module docstring), ``workers``
    (concurrent requests), ``image_size`` (side of the square image sent), ``timeout``
    (seconds per request), ``retries`` (further attempts after a failed request, with
    ``backoff`` seconds doubling between them), ``question`` (template with ``{prompt}``).
    """

    name = "unified_reward"
    value_range = (0.2, 1.0)

    def __init__(
        self,
        base_url: str | None = None,
        model: str = "UnifiedReward-7b-v1.5",
        api_key: str | None = None,
        api_key_env: str = API_KEY_ENV,
        workers: int = 8,
        image_size: int = 512,
        timeout: float = 60.0,
        retries: int = 2,
        backoff: float = 0.5,
        question: str = DEFAULT_QUESTION,
        device: str | torch.device | None = None,
        batch_size: int | None = None,
    ):
        super().__init__(device, batch_size)
        self.api_key_env = _checked_key_variable(self.name, api_key, api_key_env)
        if base_url is None:
            raise MissingWeightsError(
                f"reward {self.name!r} queries a UnifiedReward model over HTTP but no "
                f"`base_url` is set. {HOW_TO_SERVE}"
            )
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"{self.name}: base_url must be an http(s) URL, got {base_url!r}")
        if workers < 1 or image_size < 1 or retries < 0 or timeout <= 0 or backoff < 0:
            raise ValueError(
                f"{self.name}: need workers >= 1, image_size >= 1, retries >= 0, "
                f"timeout > 0 and backoff >= 0; got {workers}, {image_size}, {retries}, "
                f"{timeout}, {backoff}"
            )
        if "{prompt}" not in question:
            raise ValueError(f"{self.name}: the question must contain the placeholder {{prompt}}")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.workers = workers
        self.image_size = image_size
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.question = question
        # Built here, not per request: proxy settings are read from the environment once.
        self._opener = urllib.request.build_opener()

    def request_body(self, image: np.ndarray, prompt: str) -> dict[str, Any]:
        """The chat-completions payload for one [H, W, 3] uint8 image and its caption."""
        content = [
            {"type": "image_url", "image_url": {"url": png_data_url(image, self.image_size)}},
            {"type": "text", "text": self.question.replace("{prompt}", prompt)},
        ]
        return {
            "model": self.model,
            "temperature": 0,
            "messages": [{"role": "user", "content": content}],
        }

    def _post(self, body: dict[str, Any]) -> bytes:
        """POST ``body`` as JSON, retrying connection failures and transient statuses."""
        headers = {"Content-Type": "application/json"}
        api_key = os.environ.get(self.api_key_env)  # never kept on self: see the module doc
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        data = json.dumps(body).encode("utf-8")
        attempts = self.retries + 1
        for attempt in range(attempts):
            request = urllib.request.Request(self.url, data=data, headers=headers, method="POST")
            try:
                with self._opener.open(request, timeout=self.timeout) as response:
                    return response.read()
            except urllib.error.HTTPError as exc:
                detail = exc.read().decode("utf-8", "replace")
                failure = f"HTTP {exc.code} {exc.reason}: {_quote(detail)}"
                if exc.code not in RETRY_STATUSES:
                    raise RewardError(f"{self.name}: POST {self.url} failed: {failure}") from exc
                cause: Exception = exc
            except OSError as exc:  # refused, reset, DNS, timeouts (URLError is an OSError)
                failure = f"{type(exc).__name__}: {exc}"
                cause = exc
            if attempt + 1 < attempts:
                time.sleep(self.backoff * 2**attempt)
        raise RewardError(
            f"{self.name}: POST {self.url} failed after {attempts} attempt(s): {failure}. "
            f"Is the UnifiedReward server running? {HOW_TO_SERVE}"
        ) from cause

    def score_one(self, image: np.ndarray, prompt: str) -> float:
        """The reward of one [H, W, 3] uint8 image: the judge's 1-5 score divided by 5."""
        raw = self._post(self.request_body(image, prompt))
        try:
            reply = json.loads(raw)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            text = raw.decode("utf-8", "replace")
            raise RewardError(
                f"{self.name}: {self.url} did not return a chat completion: {_quote(text)}"
            ) from exc
        if not isinstance(reply, str):
            raise RewardError(f"{self.name}: reply content is not text: {_quote(repr(reply))}")
        value = final_score(reply)
        if value is None:
            raise RewardError(f"{self.name}: no 'Final Score: <1-5>' in the reply {_quote(reply)}")
        if not 1 <= value <= 5:
            raise RewardError(
                f"{self.name}: score {value} outside 1-5 in the reply {_quote(reply)}"
            )
        return value / 5

    def score(self, images: Tensor, prompts: list[str], metadata: Metadata | None) -> Tensor:
        arrays = to_uint8_images(images)
        pool = ThreadPoolExecutor(max_workers=min(self.workers, max(len(prompts), 1)))
        try:
            values = list(pool.map(self.score_one, arrays, prompts))
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        return torch.tensor(values, dtype=torch.float32)
