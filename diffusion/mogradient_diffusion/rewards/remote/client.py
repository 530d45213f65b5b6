"""``remote``: a reward scored by a server, over one of four wire protocols.

Rewards whose models need their own environment (official GenEval's mmdet), their own GPU
or a VLM server are scored over HTTP: ``ours`` (``serve-reward``), ``flow_grpo`` (Flow-GRPO's
reward-server), ``verl_omni`` (VeRL-Omni's HTTP scorers) or ``openai_judge`` (a VLM behind
an OpenAI-compatible API).

Concurrency: one ``httpx.Client`` per reward (its connection pool is shared between threads,
as httpx documents) and a pool of ``concurrency`` daemon threads per reward (``DaemonPool``),
kept for its lifetime. ``score`` is synchronous and called from the reward set's thread, the
background scorer's, or several at once (the reward is ``concurrent``: a reward set scores it
beside the other rewards, and on several batches at once); threads need no event loop of
their own (an async client would need one per call, and cannot run inside a caller's running
loop), the GIL is released while they wait on sockets and while PIL encodes, and one pool
shared by every caller bounds the requests in flight to ``concurrency`` however many batches
are scored at once. The threads are daemons: a request stuck on a dead server never holds
the process's exit (Ctrl-C), as a ``ThreadPoolExecutor``'s threads would.

httpx is imported when the first remote reward is built, so that runs without one never
load it (it is still a dependency of the package).
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, wait
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from ..base import Metadata, Reward, RewardError, nan_scores, to_uint8_images
from ..daemon_pool import DaemonPool
from ..registry import register_reward
from .flow_grpo import FlowGrpo
from .openai_judge import OpenAiJudge
from .ours import Ours
from .protocol import BadResponse, Protocol, one_line
from .safe_pickle import UnsafePickleError
from .verl_omni import VerlOmni

if TYPE_CHECKING:
    import httpx

logger = logging.getLogger(__name__)

# Seconds one ``score`` call (one batch; with overlap, one chunk) may take in all, retries
# included, by default: below rollout.reward_timeout's default (1800 s), so that the
# reward's own policy (required: one line; optional: NaN, counted) decides first.
DEFAULT_DEADLINE = 1500.0
# The largest answer read (after gzip or deflate): scores are a few kilobytes.
DEFAULT_MAX_RESPONSE_MIB = 64.0

PROTOCOLS: dict[str, type[Protocol]] = {
    protocol.name: protocol for protocol in (Ours, FlowGrpo, VerlOmni, OpenAiJudge)
}


class RewardServiceError(RewardError):
    """A required remote reward could not score a batch; one line naming the reward, the
    server and the cause."""


class _Failed(Exception):
    """One request that could not be scored; the message is the cause."""


class _Retry(Exception):
    """One attempt that failed in a way a retry may mend; the message is the cause."""


def retryable(status: int) -> bool:
    """A busy or briefly failing server (408, 429, 5xx); other 4xx would fail again."""
    return status in (408, 429) or status >= 500


@register_reward
class RemoteReward(Reward):
    """Scores from a reward server; see docs/diffusion/remote-rewards.md.

    Options: ``url`` (the server; for ``openai_judge`` the API root, e.g.
    ``http://host:8000/v1``), ``protocol`` (``ours``, ``flow_grpo``, ``verl_omni``,
    ``openai_judge``), ``timeout`` (seconds each step of a request may take: connecting,
    sending, each wait for the answer's bytes), ``retries`` (further attempts after a
    connection error, a time-out, 408, 429 or 5xx; never after another 4xx or a bad
    answer), ``backoff`` (seconds before the first retry, doubled for each next one),
    ``deadline`` (seconds one ``score`` call may take in all: the requests still pending
    then are abandoned and fail; keep it below ``rollout.reward_timeout``, which a config
    checks), ``max_response_mib`` (the largest answer read, decompressed), ``batch_size``
    (images per request; the protocol's default, and 1 for the one-sample protocols),
    ``concurrency`` (requests in flight at once), ``required``, ``value_range`` (scores
    outside it are a failed request; default: the protocol's, else unbounded), and the
    protocol's own: ``score_key``, ``only_strict`` (flow_grpo); ``model``,
    ``api_key_env``, ``prompt_template``, ``score_pattern``, ``score_range``,
    ``image_size`` (openai_judge).

    ``required`` (default true): a batch that cannot be scored stops training with a
    ``RewardServiceError``. A reward that quietly stops scoring changes what is optimized:
    the other rewards alone then decide the advantages, and a run "succeeds" on the wrong
    objective; so degrading is something to opt into. With ``required: false`` the
    images of a failed request score NaN (not applicable), never 0 (a real score that would
    move the group's baseline); they are counted (``failed_samples``,
    ``take_failed_samples``: the trainer warns once per epoch), and each failed request is
    logged at debug level.

    A server that went away and came back is used again at the next request: nothing is
    remembered between requests but the open connections.
    """

    name = "remote"
    concurrent = True

    def __init__(
        self,
        url: str | None = None,
        protocol: str = "ours",
        timeout: float = 120.0,
        retries: int = 2,
        backoff: float = 1.0,
        deadline: float = DEFAULT_DEADLINE,
        max_response_mib: float = DEFAULT_MAX_RESPONSE_MIB,
        batch_size: int | None = None,
        concurrency: int = 8,
        required: bool = True,
        value_range: Sequence[float] | None = None,
        score_key: str | None = None,
        only_strict: bool | None = None,
        model: str | None = None,
        api_key: str | None = None,
        api_key_env: str | None = None,
        prompt_template: str | None = None,
        score_pattern: str | None = None,
        score_range: Sequence[float] | None = None,
        image_size: int | None = None,
    ):
        super().__init__()  # the whole batch reaches score(): it splits it into requests
        own = {  # the protocols' options; those left out keep the protocol's default
            "score_key": score_key,
            "only_strict": only_strict,
            "model": model,
            "api_key": api_key,
            "api_key_env": api_key_env,
            "prompt_template": prompt_template,
            "score_pattern": score_pattern,
            "score_range": score_range,
            "image_size": image_size,
        }
        try:
            self.protocol = _protocol(protocol, {k: v for k, v in own.items() if v is not None})
            self.url = _checked_url(url)
            self.images_per_request = _images_per_request(self.protocol, batch_size)
            self.value_range = _checked_range(value_range, self.protocol.value_range)
            _check_numbers(timeout, retries, backoff, concurrency, deadline, max_response_mib)
            if not isinstance(required, bool):
                raise ValueError(f"required must be true or false, got {required!r}")
        except ValueError as error:
            raise ValueError(f"{self.name}: {error}") from None
        import httpx  # here, not at import: see the module's docstring

        self.endpoint = self.protocol.endpoint(self.url)
        self.retries, self.backoff, self.required = retries, backoff, required
        self.timeout, self.deadline = float(timeout), float(deadline)
        self.max_response_mib = float(max_response_mib)
        self._max_response_bytes = int(self.max_response_mib * 2**20)
        self._http = httpx.Client(
            timeout=self.timeout,
            limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
        )
        self._pool = DaemonPool(concurrency, "remote-reward")
        self._failed = 0
        self._failed_lock = threading.Lock()

    @property
    def failed_samples(self) -> int:
        """Images scored NaN because their request failed, since the last take."""
        return self._failed

    def take_failed_samples(self) -> int | None:
        """``failed_samples``, reset to 0: what a trainer logs once per epoch (None when
        ``required``: a failure stops the batch instead)."""
        with self._failed_lock:
            count, self._failed = self._failed, 0
        return None if self.required else count

    def close(self) -> None:
        """Drop the connections and the threads now (else they go with the reward)."""
        self._pool.close()
        self._http.close()

    def score(self, images: Tensor, prompts: list[str], metadata: Metadata | None) -> Tensor:
        """The batch's scores, its requests ``concurrency`` at a time, within ``deadline``
        seconds: a request still pending then is abandoned (one not sent never is; one on a
        socket ends soon after, each attempt's time limit being capped at the time left)
        and fails like any other."""
        end = time.monotonic() + self.deadline
        arrays = to_uint8_images(images)
        size = self.images_per_request
        starts = range(0, len(prompts), size)
        futures = [
            self._pool.submit(
                functools.partial(
                    self._request,
                    arrays[i : i + size],
                    prompts[i : i + size],
                    None if metadata is None else list(metadata[i : i + size]),
                    end,
                )
            )
            for i in starts
        ]
        scores = nan_scores(len(prompts))
        try:
            for start, future in zip(starts, futures, strict=True):
                count = min(size, len(prompts) - start)
                values = self._values(future, count, end)
                if values is not None:
                    scores[start : start + count] = values
        finally:
            for future in futures:  # a failure or the deadline ends the batch: drop the rest
                future.cancel()
        return scores

    def _values(self, future: Future, count: int, end: float) -> Tensor | None:
        """The scores of one request; None when it failed and the reward is optional."""
        done, _ = wait([future], timeout=max(end - time.monotonic(), 0.0))
        try:
            if not done:
                raise _Failed(f"no scores within the deadline of {self.deadline:g} s (abandoned)")
            values = future.result()
        except _Failed as failure:
            message = (
                f"reward {self.name!r}: {self.endpoint} could not score {count} image(s): {failure}"
            )
            if self.required:
                raise RewardServiceError(message) from None
            with self._failed_lock:
                self._failed += count
            logger.debug("%s; scored NaN (required: false)", message)
            return None
        return torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float32)

    def _request(
        self, images: np.ndarray, prompts: list[str], metadata: Metadata | None, end: float
    ) -> Sequence[float | None]:
        """One request's scores, checked; ``_Failed`` with the cause when there are none."""
        answer = self._post(self.protocol.encode(images, prompts, metadata), end)
        try:
            values = self.protocol.decode(answer, self.endpoint)
        except (BadResponse, UnsafePickleError) as error:
            raise _Failed(str(error)) from None
        except Exception as error:  # anything else an untrusted answer provokes is one too
            cause = f"{type(error).__name__}: {one_line(str(error)) or '(no message)'}"
            raise _Failed(f"the answer could not be read ({cause})") from None
        if len(values) != len(prompts):
            raise _Failed(f"the server answered {len(values)} scores for {len(prompts)} images")
        low, high = self.value_range
        for value in values:
            if value is not None and not math.isfinite(value):
                raise _Failed(f"the server answered the non-finite score {value}")
            if value is not None and not low <= value <= high:
                raise _Failed(f"the score {value:g} is outside value_range [{low:g}, {high:g}]")
        return values

    def _post(self, body: bytes, end: float) -> bytes:
        """POST ``body``, retrying what a busy or restarting server causes, until the
        attempts or the deadline (``end``, on ``time.monotonic``) run out."""
        attempts = self.retries + 1
        cause = ""
        for attempt in range(attempts):
            pause = self.backoff * 2 ** (attempt - 1) if attempt else 0.0
            left = end - time.monotonic() - pause
            if left <= 0:
                if not attempt:
                    raise _Failed(f"the deadline of {self.deadline:g} s passed before it was sent")
                raise _Failed(f"{cause} (after {attempt} attempt(s); then the deadline)")
            time.sleep(pause)
            try:
                return self._attempt(body, min(self.timeout, left))
            except _Retry as retry:
                cause = str(retry)
        raise _Failed(f"{cause} (after {attempts} attempt(s))")

    def _attempt(self, body: bytes, timeout: float) -> bytes:
        """One POST: the answer's body; ``_Retry`` or ``_Failed`` with the cause."""
        import httpx

        headers = self.protocol.headers()
        try:
            with self._http.stream(
                "POST", self.endpoint, content=body, headers=headers, timeout=timeout
            ) as response:
                content = self._read(response)
        except httpx.TimeoutException as error:
            raise _Retry(f"no answer within {timeout:.3g} s ({type(error).__name__})") from None
        except httpx.TransportError as error:  # refused, reset, closed mid-answer
            raise _Retry(f"{type(error).__name__}: {one_line(str(error))}") from None
        except httpx.RequestError as error:  # DecodingError (corrupt gzip): same answer again
            raise _Failed(f"{type(error).__name__}: {one_line(str(error))}") from None
        if response.is_success:
            return content
        detail = self.protocol.error_detail(content, self.endpoint)
        cause = f"HTTP {response.status_code}: {detail}"
        if retryable(response.status_code):
            raise _Retry(cause)
        raise _Failed(cause)

    def _read(self, response: httpx.Response) -> bytes:
        """The answer's body, decompressed; ``_Failed`` past ``max_response_mib``."""
        limit = self._max_response_bytes
        too_large = f"the answer is larger than max_response_mib ({self.max_response_mib:g} MiB)"
        length = response.headers.get("Content-Length", "")
        if length.isdigit() and int(length) > limit:  # compressed: larger still once read
            raise _Failed(too_large)
        chunks, size = [], 0
        for chunk in response.iter_bytes():
            size += len(chunk)
            if size > limit:
                raise _Failed(too_large)
            chunks.append(chunk)
        return b"".join(chunks)


def _protocol(name: Any, options: dict[str, Any]) -> Protocol:
    """The protocol ``name`` built with its own ``options``; the others' are refused."""
    if name not in PROTOCOLS:
        raise ValueError(f"unknown protocol {name!r}; choose one of {sorted(PROTOCOLS)}")
    cls = PROTOCOLS[name]
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    parameters = inspect.signature(cls.__init__).parameters.values()
    accepted = [p.name for p in parameters if p.kind in named and p.name != "self"]
    foreign = sorted(set(options) - set(accepted))
    if foreign:
        own = f"its own: {accepted}" if accepted else "it has none of its own"
        raise ValueError(f"option(s) {foreign} do not apply to protocol {name!r} ({own})")
    return cls(**options)


def _checked_url(url: Any) -> str:
    import httpx

    example = "e.g. http://127.0.0.1:18090 for serve-reward"
    if url is None:
        raise ValueError(f"the option url is required: the server's address, {example}")
    try:
        parsed = httpx.URL(url) if isinstance(url, str) else None
    except httpx.InvalidURL:
        parsed = None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"url must be an http(s) address, {example}; got {url!r}")
    return url


def _images_per_request(protocol: Protocol, batch_size: Any) -> int:
    fixed = protocol.images_per_request
    if batch_size is None:
        return fixed or protocol.default_batch_size
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive number of images, got {batch_size!r}")
    if fixed is not None and batch_size != fixed:
        raise ValueError(
            f"protocol {protocol.name!r} sends {fixed} image(s) per request: leave batch_size "
            "out (use concurrency for requests in flight)"
        )
    return batch_size


def _checked_range(value: Any, default: tuple[float, float]) -> tuple[float, float]:
    if value is None:
        return default
    if isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 2:
        low, high = value
        numbers = all(isinstance(x, (int, float)) and not math.isnan(x) for x in (low, high))
        if numbers and low <= high:
            return float(low), float(high)
    raise ValueError(f"value_range must be [low, high] with low <= high, got {value!r}")


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_numbers(
    timeout: Any,
    retries: Any,
    backoff: Any,
    concurrency: Any,
    deadline: Any,
    max_response_mib: Any,
) -> None:
    if not (_number(timeout) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if not (_count(retries) and retries >= 0):
        raise ValueError(f"retries must be a whole number >= 0, got {retries!r}")
    if not (_number(backoff) and backoff >= 0):
        raise ValueError(f"backoff must be a number of seconds >= 0, got {backoff!r}")
    if not (_count(concurrency) and concurrency >= 1):
        raise ValueError(f"concurrency must be a whole number >= 1, got {concurrency!r}")
    if not (_number(deadline) and deadline > 0):
        raise ValueError(
            f"deadline must be a positive number of seconds (one batch, in all), got {deadline!r}"
        )
    if not (_number(max_response_mib) and max_response_mib > 0):
        raise ValueError(f"max_response_mib must be a positive number, got {max_response_mib!r}")
