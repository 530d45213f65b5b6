"""Score image chunks on a worker thread while the caller samples the next chunk.

The references overlap reward scoring with sampling through a thread pool; model
rewards and Tesseract release the GIL, so on a GPU (or with rewards pinned to another
device) scoring hides behind sampling. One worker keeps the chunks in order and the
reward models single-threaded; the result equals scoring the whole batch at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor

from .base import Metadata
from .reward_set import RewardScores, RewardSet


class BackgroundScoring:
    """``submit(rows, images)`` per chunk, then ``collect()`` the [B, K] scores in order."""

    def __init__(
        self, rewards: RewardSet, prompts: Sequence[str], metadata: Metadata | None = None
    ):
        self.rewards = rewards
        self.prompts = list(prompts)
        self.metadata = None if metadata is None else list(metadata)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rewards")
        self._futures: list[Future[RewardScores]] = []

    def submit(self, rows: slice, images: Tensor) -> None:
        metadata = None if self.metadata is None else self.metadata[rows]
        self._futures.append(self._pool.submit(self.rewards, images, self.prompts[rows], metadata))

    def collect(self) -> RewardScores:
        """Wait for every chunk; the first reward error is raised here, naming the reward."""
        try:
            results = [future.result() for future in self._futures]
        finally:
            self._pool.shutdown(cancel_futures=True)
        seconds = {name: sum(r.seconds[name] for r in results) for name in self.rewards.names}
        if not results:
            return RewardScores(torch.empty(0, len(self.rewards)), seconds)
        return RewardScores(torch.cat([r.values for r in results]), seconds)
