"""Score image chunks on a worker thread while the caller samples the next chunk.

The references overlap reward scoring with sampling through a thread pool; model
rewards and Tesseract release the GIL, so on a GPU (or with rewards pinned to another
device) scoring hides behind sampling. One worker keeps the chunks in order and the
reward models single-threaded; the result equals scoring the whole batch at once.

The worker is a daemon thread, not a ``ThreadPoolExecutor``'s (whose threads the
interpreter joins at exit): Ctrl-C, or a failed chunk, never waits for the chunk being
scored, and a hung reward cannot keep the process alive.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch
from torch import Tensor

from .base import Metadata
from .reward_set import RewardScores, RewardSet, as_on_this_thread

# A chunk to score: its future and its scoring; None ends the worker.
Job = tuple[Future, Callable[[], RewardScores]]


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
        self._futures: list[Future[RewardScores]] = []
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        threading.Thread(target=self._work, name="rewards", daemon=True).start()

    def submit(self, rows: slice, images: Tensor) -> None:
        metadata = None if self.metadata is None else self.metadata[rows]
        future: Future[RewardScores] = Future()
        self._futures.append(future)
        score = functools.partial(self.rewards, images, self.prompts[rows], metadata)
        self._jobs.put((future, as_on_this_thread(score)))

    def collect(self) -> RewardScores:
        """Wait for every chunk; the first reward error is raised here, naming the reward."""
        try:
            results = [future.result() for future in self._futures]
        finally:
            self.close()
        seconds = {name: sum(r.seconds[name] for r in results) for name in self.rewards.names}
        if not results:
            return RewardScores(torch.empty(0, len(self.rewards)), seconds)
        return RewardScores(torch.cat([r.values for r in results]), seconds)

    def close(self) -> None:
        """Drop the chunks not started and let the worker end; waits for nothing."""
        for future in self._futures:
            future.cancel()
        self._jobs.put(None)

    def _work(self) -> None:
        """Score the chunks in order, each as on the thread that submitted it; after a
        failed one, the rest are dropped."""
        while (job := self._jobs.get()) is not None:
            future, score = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(score())
            except BaseException as error:
                future.set_exception(error)
                self.close()
