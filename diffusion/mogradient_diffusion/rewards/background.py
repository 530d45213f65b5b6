"""Score image chunks on worker threads while the caller samples the next chunk.

The references overlap reward scoring with sampling through a thread pool; model
rewards and Tesseract release the GIL, so on a GPU (or with rewards pinned to another
device) scoring hides behind sampling. Two lanes:

* the rewards of this process (``Reward.concurrent`` false): one worker, chunk after
  chunk and reward after reward in the listed order, so reward models stay
  single-threaded and the result equals scoring the whole batch at once;
* the rewards that wait on servers: ``MAX_BATCHES_IN_FLIGHT`` workers, each scoring one
  chunk with all of them at once (``RewardSet.score``).

Every reward is waited for at most the reward set's timeout per chunk, from its start.
The workers are daemon threads (``DaemonPool``): Ctrl-C, or a failed chunk, never waits
for a chunk being scored, and a hung reward cannot keep the process alive.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from concurrent.futures import CancelledError, Future

import torch
from torch import Tensor

from .base import Metadata
from .daemon_pool import DaemonPool
from .reward_set import Columns, RewardScores, RewardSet, as_on_this_thread

# Chunks the server-bound rewards score at once. Two are what overlapping needs: the chunk
# just sampled starts at once while the one before it finishes, so a server's latency
# hides behind sampling as long as a chunk is scored within two chunks' sampling time.
# More would only queue further work on servers that are already the slower side, and
# every chunk in flight holds copies of its images and its encoded requests: chunks
# beyond two wait as references to images the rollout keeps anyway.
MAX_BATCHES_IN_FLIGHT = 2


class BackgroundScoring:
    """``submit(rows, images)`` per chunk, then ``collect()`` the [B, K] scores in order.

    ``close()`` (``collect`` calls it) drops the chunks not yet started; a caller that
    stops early calls it too.
    """

    def __init__(
        self, rewards: RewardSet, prompts: Sequence[str], metadata: Metadata | None = None
    ):
        self.rewards = rewards
        self.prompts = list(prompts)
        self.metadata = None if metadata is None else list(metadata)
        concurrent = [k for k, reward in enumerate(rewards.rewards) if reward.concurrent]
        here = [k for k in range(len(rewards)) if k not in concurrent]
        lanes = [(here, 1, "rewards"), (concurrent, MAX_BATCHES_IN_FLIGHT, "remote-rewards")]
        self._lanes = [(ks, DaemonPool(workers, name)) for ks, workers, name in lanes if ks]
        self._chunks: list[list[Future[Columns]]] = []
        self._failure: BaseException | None = None
        self._lock = threading.Lock()

    def submit(self, rows: slice, images: Tensor) -> None:
        metadata = None if self.metadata is None else self.metadata[rows]
        prompts = self.prompts[rows]
        with self._lock:
            if self._failure is not None:  # collect raises it; nothing more is scored
                return
            futures = []
            for indices, pool in self._lanes:
                score = functools.partial(self._score, indices, images, prompts, metadata)
                futures.append(pool.submit(as_on_this_thread(score)))
            self._chunks.append(futures)

    def collect(self) -> RewardScores:
        """Wait for every chunk; the first reward error is raised here, naming the reward."""
        try:
            results = [[self._result(future) for future in chunk] for chunk in self._chunks]
        finally:
            self.close()
        seconds = {name: 0.0 for name in self.rewards.names}
        rows = []
        for parts in results:
            values = {k: v for part in parts for k, v in part.values.items()}
            rows.append(torch.stack([values[k] for k in range(len(self.rewards))], dim=1))
            for part in parts:
                for name, value in part.seconds.items():
                    seconds[name] += value
        if not rows:
            return RewardScores(torch.empty(0, len(self.rewards)), seconds)
        return RewardScores(torch.cat(rows), seconds)

    def close(self) -> None:
        """Drop the chunks not started and let the workers end; waits for nothing."""
        for _, pool in self._lanes:
            pool.close()

    def _score(
        self, indices: list[int], images: Tensor, prompts: list[str], metadata: Metadata | None
    ) -> Columns:
        """One lane's rewards on one chunk; after a failure, the chunks not started are
        dropped."""
        try:
            return self.rewards.score(indices, images, prompts, metadata)
        except BaseException as error:
            with self._lock:
                self._failure = self._failure or error
                self.close()
            raise

    def _result(self, future: Future[Columns]) -> Columns:
        """A chunk's scores; for a chunk dropped after a failure, that failure."""
        try:
            return future.result()
        except CancelledError:
            if self._failure is None:
                raise
            raise self._failure from None
