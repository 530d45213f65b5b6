"""Score one batch with K rewards: the B x K matrix that per-reward advantages start from.

Each reward scores on a thread of its own, waited for at most ``timeout`` seconds. A
Python thread cannot be stopped: a reward that hangs is abandoned on its thread (a daemon,
so it never keeps the process alive) and the batch fails with a ``RewardTimeout`` naming it.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import NamedTuple, TypeVar

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


class RewardSet:
    """K rewards applied in order; any failure stops the batch with the reward named.

    ``timeout``: seconds each reward may take on one call (None: no limit, and no thread).
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

    def to(self, device: str | torch.device) -> RewardSet:
        """Move every reward not pinned to a device of its own to ``device``; returns self."""
        for reward in self.rewards:
            if not reward.pinned_device:
                reward.to(device)
        return self

    def __call__(
        self, images: Tensor, prompts: Sequence[str], metadata: Metadata | None = None
    ) -> RewardScores:
        """Score ``images`` [B, 3, H, W] in [0, 1] with every reward -> [B, K] float32.

        Each reward gets its own copy of the images, prompts and metadata: one that edits
        its inputs in place must not change what the rewards after it score.
        """
        columns, seconds = [], {}
        for reward in self.rewards:
            start = time.perf_counter()
            inputs = (images.clone(), list(prompts), copy.deepcopy(metadata))
            try:
                columns.append(self._score(reward, *inputs))
            except RewardError:
                raise
            except torch.cuda.OutOfMemoryError as exc:  # the batch's size, not a reward bug
                raise RewardError(
                    f"reward {reward.name!r} ran out of GPU memory scoring {len(prompts)} "
                    "images: lower its batch_size option (images per call), or give it a "
                    "GPU of its own with its device option"
                ) from exc
            except Exception as exc:
                raise RewardError(f"reward {reward.name!r} failed: {exc}") from exc
            except SystemExit as exc:  # a reward must not end training silently
                raise RewardError(
                    f"reward {reward.name!r} called sys.exit({exc.code!r}) while scoring"
                ) from exc
            seconds[reward.name] = time.perf_counter() - start
        return RewardScores(torch.stack(columns, dim=1), seconds)

    def _score(
        self, reward: Reward, images: Tensor, prompts: list[str], metadata: Metadata | None
    ) -> Tensor:
        """``reward(...)`` on a daemon thread, waited for ``timeout`` seconds at most; its
        errors are raised here. Without a timeout, on this thread."""
        if self.timeout is None:
            return reward(images, prompts, metadata)
        outcome: Future[Tensor] = Future()
        score = as_on_this_thread(lambda: reward(images, prompts, metadata))

        def run() -> None:
            try:
                outcome.set_result(score())
            except BaseException as error:  # SystemExit too: the caller names it
                outcome.set_exception(error)

        thread = threading.Thread(target=run, name=f"reward {reward.name}", daemon=True)
        thread.start()
        thread.join(self.timeout)
        if thread.is_alive():
            raise RewardTimeout(
                f"reward {reward.name!r} did not finish scoring {len(prompts)} images within "
                f"{self.timeout:g} s: it hangs or is far too slow (its thread cannot be "
                "stopped: it is abandoned and ends with the process)"
            )
        return outcome.result()


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
