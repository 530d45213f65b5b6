"""Score one batch with K rewards: the B x K matrix that per-reward advantages start from.

Each reward scores on a thread of its own, waited for at most ``timeout`` seconds from its
start on the batch: the time a remote reward's requests then wait for its ``concurrency``
(shared with the other batch it may be scoring) counts. A Python thread cannot be
stopped: a reward that hangs is abandoned on its thread (a daemon, so it never keeps the
process alive) and the batch fails with a ``RewardTimeout`` naming it. Rewards that wait
on servers (``Reward.concurrent``) are all started first and score while the others run
one after another, in order, as they always have.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, wait
from typing import NamedTuple, NoReturn, TypeVar

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from .base import Metadata, Reward, RewardError, RewardTimeout

# Seconds one reward may take on one batch unless told otherwise: far beyond any reward
# that works (a batch of a training epoch), so only a hung one reaches it.
DEFAULT_TIMEOUT = 1800.0

T = TypeVar("T")


class RewardScores(NamedTuple):
    """``values[b, k]``: reward k of image b (NaN: not applicable); seconds per reward.

    A tuple, so ``values, seconds = reward_set(images, prompts)`` works.
    """

    values: Tensor
    seconds: dict[str, float]


class Columns(NamedTuple):
    """Some rewards' scores of one batch: [B] per reward index, seconds per reward name."""

    values: dict[int, Tensor]
    seconds: dict[str, float]


class RewardSet:
    """K rewards applied in order; any failure stops the batch with the reward named.

    ``timeout``: seconds each reward may take on one call (None: no limit; the rewards that
    are not ``concurrent`` then score on the calling thread).
    """

    def __init__(self, rewards: Sequence[Reward], timeout: float | None = DEFAULT_TIMEOUT):
        if timeout is not None and not timeout > 0:
            raise ValueError(f"the reward timeout must be > 0 seconds (or none), got {timeout}")
        names = [reward.name for reward in rewards]
        if not names:
            raise ValueError("RewardSet needs at least one reward")
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate reward names: {duplicates}")
        self.rewards = tuple(rewards)
        self.names = tuple(names)
        self.timeout = timeout

    def __len__(self) -> int:
        return len(self.rewards)

    def close(self) -> None:
        """Close every reward (``Reward.close``): at the end of a run or an evaluation."""
        for reward in self.rewards:
            reward.close()

    def to(self, device: str | torch.device) -> RewardSet:
        """Move every reward not pinned to a device of its own to ``device``; returns self."""
        for reward in self.rewards:
            if not reward.pinned_device:
                reward.to(device)
        return self

    def __call__(
        self, images: Tensor, prompts: Sequence[str], metadata: Metadata | None = None
    ) -> RewardScores:
        """Score ``images`` [B, 3, H, W] in [0, 1] with every reward -> [B, K] float32."""
        columns = self.score(range(len(self)), images, prompts, metadata)
        values = torch.stack([columns.values[k] for k in range(len(self))], dim=1)
        return RewardScores(values, columns.seconds)

    def score(
        self,
        indices: Iterable[int],
        images: Tensor,
        prompts: Sequence[str],
        metadata: Metadata | None = None,
    ) -> Columns:
        """The rewards at ``indices`` on one batch: the concurrent ones started first, each
        on a thread of its own, then the others one after another in order, then the
        concurrent ones' scores waited for in order. The first error is raised, named.

        Each reward gets its own copy of the images, prompts and metadata: one that edits
        its inputs in place must not change what the other rewards score.
        """
        indices = list(indices)
        started = {
            k: _Scoring(self.rewards[k], images, prompts, metadata)
            for k in indices
            if self.rewards[k].concurrent
        }
        values: dict[int, Tensor] = {}
        seconds: dict[int, float] = {}
        for k in indices:
            if k in started:
                continue
            start = time.perf_counter()
            values[k] = self._score_here(self.rewards[k], images, prompts, metadata)
            seconds[k] = time.perf_counter() - start
        for k, scoring in started.items():
            values[k] = scoring.result(self.timeout)
            seconds[k] = scoring.seconds
        return Columns(values, {self.names[k]: seconds[k] for k in indices})

    def _score_here(
        self, reward: Reward, images: Tensor, prompts: Sequence[str], metadata: Metadata | None
    ) -> Tensor:
        """One reward that is not concurrent: on a daemon thread, waited for ``timeout``
        seconds at most; without a timeout, on this thread."""
        if self.timeout is not None:
            return _Scoring(reward, images, prompts, metadata).result(self.timeout)
        inputs = (images.clone(), list(prompts), copy.deepcopy(metadata))
        try:
            return reward(*inputs)
        except (Exception, SystemExit) as error:
            _raise_named(reward, len(inputs[1]), error)


class _Scoring:
    """One reward scoring one batch on a daemon thread of its own, from now on."""

    def __init__(
        self, reward: Reward, images: Tensor, prompts: Sequence[str], metadata: Metadata | None
    ):
        self.reward = reward
        self.count = len(prompts)
        self.seconds = float("nan")
        self._started = time.perf_counter()
        inputs = (images.clone(), list(prompts), copy.deepcopy(metadata))
        self._outcome: Future[Tensor] = Future()
        score = as_on_this_thread(lambda: reward(*inputs))
        name = f"reward {reward.name}"
        threading.Thread(target=self._run, args=(score,), name=name, daemon=True).start()

    def _run(self, score: Callable[[], Tensor]) -> None:
        try:
            values = score()
        except BaseException as error:  # SystemExit too: result() names it
            self.seconds = time.perf_counter() - self._started
            self._outcome.set_exception(error)
        else:
            self.seconds = time.perf_counter() - self._started
            self._outcome.set_result(values)

    def result(self, timeout: float | None) -> Tensor:
        """The scores, waited for until ``timeout`` seconds after the start (None: no
        limit); the reward's error, named; ``RewardTimeout`` when it is not done by then."""
        left = None if timeout is None else self._started + timeout - time.perf_counter()
        done, _ = wait([self._outcome], timeout=None if left is None else max(left, 0.0))
        if not done:
            raise RewardTimeout(
                f"reward {self.reward.name!r} did not finish scoring {self.count} images within "
                f"{timeout:g} s: it hangs or is far too slow (its thread cannot be "
                "stopped: it is abandoned and ends with the process)"
            )
        error = self._outcome.exception()
        if error is not None:
            _raise_named(self.reward, self.count, error)
        return self._outcome.result()


def _raise_named(reward: Reward, count: int, error: BaseException) -> NoReturn:
    """Raise ``error`` as a RewardError naming ``reward`` (a RewardError as it is)."""
    if isinstance(error, RewardError) or not isinstance(error, (Exception, SystemExit)):
        raise error
    if isinstance(error, torch.cuda.OutOfMemoryError):  # the batch's size, not a reward bug
        raise RewardError(
            f"reward {reward.name!r} ran out of GPU memory scoring {count} images: lower its "
            "batch_size option (images per call), or give it a GPU of its own with its "
            "device option"
        ) from error
    if isinstance(error, SystemExit):  # a reward must not end training silently
        raise RewardError(
            f"reward {reward.name!r} called sys.exit({error.code!r}) while scoring"
        ) from error
    raise RewardError(f"reward {reward.name!r} failed: {error}") from error


def as_on_this_thread(function: Callable[[], T]) -> Callable[[], T]:
    """``function``, to be run on another thread as it would run on this one: in this
    thread's grad mode, CUDA device and dispatch modes (a device guard, fake tensors),
    which torch keeps per thread."""
    grad = torch.is_grad_enabled()
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
    modes = _get_current_dispatch_mode_stack()

    def run() -> T:
        if device is not None:
            torch.cuda.set_device(device)
        with torch.set_grad_enabled(grad), contextlib.ExitStack() as entered:
            for mode in modes:
                entered.enter_context(mode)
            return function()

    return run
