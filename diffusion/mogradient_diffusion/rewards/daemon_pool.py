"""A thread pool whose threads never hold the process: a fixed set of daemon threads
running submitted calls in order.

``concurrent.futures.ThreadPoolExecutor`` joins its threads when the interpreter exits, so
a call stuck on a server that stopped answering would hold Ctrl-C's exit for as long as
its socket waits (minutes, with retries). Daemon threads end with the process: a call
that cannot be stopped is abandoned, and ``close`` cancels the calls not yet started.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")
Job = tuple[Future, Callable[[], Any]]


class DaemonPool:
    """``workers`` daemon threads taking submitted calls first in, first out. The threads
    end after ``close``, or once the pool is no longer referenced."""

    def __init__(self, workers: int, name: str):
        if workers < 1:
            raise ValueError(f"{name}: a pool needs at least one worker, got {workers}")
        self.name = name
        self._workers = workers
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        for index in range(workers):  # the threads hold the queue, not the pool
            worker = threading.Thread(
                target=_work, args=(self._jobs, self._closed), name=f"{name}-{index}", daemon=True
            )
            worker.start()
        weakref.finalize(self, _stop, self._jobs, workers)

    def submit(self, function: Callable[[], T]) -> Future[T]:
        """``function()`` on the next free worker; its result or exception in the future."""
        future: Future[T] = Future()
        with self._lock:
            if self._closed.is_set():
                raise RuntimeError(f"{self.name}: the pool is closed")
            self._jobs.put((future, function))
        return future

    def close(self) -> None:
        """Cancel the calls not started and let the workers end; waits for none of them."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        _stop(self._jobs, self._workers)


def _work(jobs: queue.SimpleQueue[Job | None], closed: threading.Event) -> None:
    while (job := jobs.get()) is not None:
        future, function = job
        del job
        if closed.is_set():  # taken while close() was emptying the queue
            future.cancel()
        elif future.set_running_or_notify_cancel():
            _run(future, function)
        del future, function  # a finished call's inputs are not kept while waiting


def _run(future: Future, function: Callable[[], Any]) -> None:
    try:
        result = function()
    except BaseException as error:  # SystemExit too: the caller decides
        future.set_exception(error)
    else:
        future.set_result(result)


def _stop(jobs: queue.SimpleQueue[Job | None], workers: int) -> None:
    """One end mark per worker, after the calls already queued."""
    for _ in range(workers):
        jobs.put(None)
