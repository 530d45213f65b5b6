"""Scoring with servers, concurrently: remote rewards beside each other and (overlapped with
sampling) on two batches at once, never more; rewards of this process still one at a time,
in order, with the same scores; every reward under its timeout per batch; and Ctrl-C never
waits for a reward that hangs, in the scorer or at the process's exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError
from pathlib import Path

import pytest
import torch

from mogradient_diffusion.rewards import Reward, RewardSet, make_reward
from mogradient_diffusion.rewards.background import MAX_BATCHES_IN_FLIGHT, BackgroundScoring
from mogradient_diffusion.rewards.base import RewardTimeout
from mogradient_diffusion.rewards.daemon_pool import DaemonPool
from mogradient_diffusion.rewards.remote import RemoteReward, RewardServiceError

from . import fakes
from .fakes import Answer, Received

ROOT = Path(__file__).resolve().parents[3]
PROMPTS = [f"prompt {i}" for i in range(10)]


def images(count: int = 10) -> torch.Tensor:
    return torch.rand(count, 3, 16, 16, generator=torch.Generator().manual_seed(0))


def gathered(count: int, seconds: float) -> Callable[[Received], Answer]:
    """DeQA's answer, held until ``count`` requests are in flight at once (10 s at most:
    fewer is then what the client sent at once), then ``seconds`` per answer: the tests
    see the concurrency the client allows, however slowly its threads start."""
    gate = threading.Condition()
    arrived = 0

    def answer(request: Received) -> Answer:
        nonlocal arrived
        with gate:
            arrived += 1
            gate.notify_all()
            gate.wait_for(lambda: arrived >= count, timeout=10)
        time.sleep(seconds)
        return fakes.deqa(request)

    return answer


class InOrder(Reward):
    """A reward of this process: the first pixel; records the batches it scores and whether
    another call of it was running at the time."""

    name = "in_order"
    value_range = (0.0, 1.0)

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[list[str]] = []
        self.running = 0
        self.overlapped = False

    def score(self, images, prompts, metadata):
        self.running += 1
        self.overlapped |= self.running > 1
        self.calls.append(prompts)
        time.sleep(0.01)
        self.running -= 1
        return images[:, 0, 0, 0]


class Hung(Reward):
    """A reward that waits on a server which never answers (until ``release``)."""

    name = "hung"
    value_range = (0.0, 1.0)
    concurrent = True

    def __init__(self, release: threading.Event, seconds: float | None = None) -> None:
        super().__init__()
        self.release, self.seconds = release, seconds
        self.calls: list[int] = []  # appended from several threads: a list, not a counter
        self.started = threading.Semaphore(0)  # released once per call

    def score(self, images, prompts, metadata):
        self.calls.append(len(prompts))
        self.started.release()
        self.release.wait(self.seconds)
        return torch.zeros(len(prompts))


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """Lets this test's hung rewards return once it is over."""
    event = threading.Event()
    yield event
    event.set()


def remote(url: str, label: str) -> RemoteReward:
    reward = make_reward("remote", url=url, protocol="flow_grpo", batch_size=16, retries=0)
    reward.name = label  # what a config's label does
    return reward


def test_remote_rewards_score_at_once_on_two_batches_and_in_process_ones_in_order() -> None:
    """Two remote rewards on one server (0.5 s an answer), five chunks submitted at once:
    2 rewards x 2 chunks in flight, never more; the reward of this process sees the chunks
    one at a time, in order; the scores are those of the whole batch scored at once."""
    in_order = InOrder()
    with fakes.serving(gathered(2 * MAX_BATCHES_IN_FLIGHT, 0.05)) as server:
        first, second = remote(server.url, "first"), remote(server.url, "second")
        try:
            rewards = RewardSet([first, in_order, second], timeout=30)
            scoring = BackgroundScoring(rewards, PROMPTS)
            for start in range(0, 10, 2):
                scoring.submit(slice(start, start + 2), images()[start : start + 2])
            values, seconds = scoring.collect()
            whole = rewards(images(), PROMPTS).values
        finally:
            first.close()
            second.close()
    assert server.max_in_flight == 2 * MAX_BATCHES_IN_FLIGHT  # reached: the gate waits for it
    assert torch.equal(values, whole)
    assert in_order.calls == [PROMPTS[i : i + 2] for i in range(0, 10, 2)] + [PROMPTS]
    assert not in_order.overlapped
    assert seconds["first"] >= 5 * 0.05 and list(seconds) == ["first", "in_order", "second"]


def test_a_reward_set_scores_remote_rewards_beside_the_others() -> None:
    """Sequential scoring (no overlap) scores both remote rewards at once too."""
    with fakes.serving(gathered(2, 0.0)) as server:
        first, second = remote(server.url, "first"), remote(server.url, "second")
        try:
            values, _ = RewardSet([first, InOrder(), second], timeout=30)(images(), PROMPTS)
        finally:
            first.close()
            second.close()
    assert server.max_in_flight == 2
    assert torch.equal(values[:, 0], values[:, 2]) and not values.isnan().any()


def test_the_timeout_bounds_each_reward_on_each_batch(release: threading.Event) -> None:
    """0.5 s a chunk, 2 at a time: 8 chunks take 2 s, beyond the 1.5 s timeout, which each
    chunk meets with a second to spare (a chunk waiting for a slot has not started)."""
    slow = Hung(release, seconds=0.5)
    scoring = BackgroundScoring(RewardSet([slow, InOrder()], timeout=1.5), PROMPTS[:8] * 2)
    started = time.monotonic()
    for start in range(0, 16, 2):
        scoring.submit(slice(start, start + 2), images(16)[start : start + 2])
    assert scoring.collect().values.shape == (16, 2) and len(slow.calls) == 8
    assert time.monotonic() - started > 1.5

    hung = Hung(release)
    scoring = BackgroundScoring(RewardSet([InOrder(), hung], timeout=0.5), PROMPTS[:4])
    started = time.monotonic()
    for start in range(0, 4, 2):
        scoring.submit(slice(start, start + 2), images(4)[start : start + 2])
    with pytest.raises(RewardTimeout, match=r"^reward 'hung' did not finish scoring 2 images"):
        scoring.collect()
    assert time.monotonic() - started < 5


class Refused(Reward):
    """A required remote reward whose server refuses every request."""

    name = "refused"
    value_range = (0.0, 1.0)
    concurrent = True

    def score(self, images, prompts, metadata):
        raise RewardServiceError("reward 'refused': http://127.0.0.1:1 could not score")


def test_chunks_sampled_after_a_failure_are_dropped_and_the_failure_is_raised() -> None:
    scoring = BackgroundScoring(RewardSet([InOrder(), Refused()]), PROMPTS[:4])
    scoring.submit(slice(0, 2), images(4)[:2])
    deadline = time.monotonic() + 10
    while scoring._failure is None and time.monotonic() < deadline:
        time.sleep(0.01)
    scoring.submit(slice(2, 4), images(4)[2:])  # the sampler goes on meanwhile
    with pytest.raises(RewardServiceError, match=r"^reward 'refused': http"):
        scoring.collect()


def test_ctrl_c_while_a_remote_reward_hangs_stops_at_once(release: threading.Event) -> None:
    """SIGINT to the main thread while it waits on a hung reward (no timeout at all): the
    interrupt is raised at once, and the chunk not yet started is dropped."""
    hung = Hung(release)
    scoring = BackgroundScoring(RewardSet([hung], timeout=None), PROMPTS[:6])
    for start in range(0, 6, 2):
        scoring.submit(slice(start, start + 2), images(6)[start : start + 2])
    main = threading.main_thread().ident

    sent: list[float] = []

    def waiting_in_collect() -> bool:
        frame = sys._current_frames().get(main)
        while frame is not None and frame.f_code is not BackgroundScoring.collect.__code__:
            frame = frame.f_back
        return frame is not None

    def interrupt_once_both_chunks_hang() -> None:
        """SIGINT once both chunks hang and the main thread waits for them in collect (a
        signal sent before would interrupt the test itself)."""
        if not all(hung.started.acquire(timeout=30) for _ in range(MAX_BATCHES_IN_FLIGHT)):
            return
        deadline = time.monotonic() + 30
        while not waiting_in_collect():
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)
        sent.append(time.monotonic())
        signal.pthread_kill(main, signal.SIGINT)

    interrupter = threading.Thread(target=interrupt_once_both_chunks_hang, daemon=True)
    interrupter.start()
    with pytest.raises(KeyboardInterrupt):
        scoring.collect()
    assert time.monotonic() - sent[0] < 5
    interrupter.join(5)
    assert len(hung.calls) == MAX_BATCHES_IN_FLIGHT
    assert scoring._chunks[2][0].cancelled()  # the third chunk: dropped, never to start


@pytest.mark.timeout(180)  # a process of its own, importing torch
def test_a_daemon_pool_cancels_what_waits_and_never_holds_the_exit() -> None:
    pool = DaemonPool(1, "test")
    gate = threading.Event()
    running = pool.submit(lambda: gate.wait(10))
    waiting = pool.submit(lambda: "never")
    while not running.running():
        time.sleep(0.01)
    pool.close()
    with pytest.raises(CancelledError):
        waiting.result(5)
    gate.set()
    assert running.result(5) is True
    with pytest.raises(RuntimeError, match="the pool is closed"):
        pool.submit(lambda: None)
    forgotten = DaemonPool(2, "forgotten")
    assert forgotten.submit(lambda: 7).result(5) == 7
    del forgotten  # an unreferenced pool ends its threads, as a ThreadPoolExecutor does
    deadline = time.monotonic() + 5
    while any(t.name.startswith("forgotten-") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the threads of a forgotten pool went on"
        time.sleep(0.01)
    script = (
        "import threading\n"
        "from mogradient_diffusion.rewards.daemon_pool import DaemonPool\n"
        "DaemonPool(1, 'stuck').submit(threading.Event().wait)\n"
        "print('exiting', flush=True)\n"
    )
    environment = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'diffusion'}"}
    result = subprocess.run(
        [sys.executable, "-c", script], env=environment, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and result.stdout == "exiting\n"


@pytest.mark.timeout(300)  # a training process: up to 90 s to ask the server, 30 to end
def test_ctrl_c_in_training_while_a_server_hangs_ends_the_process_at_once(
    tmp_path: Path, tiny_pipeline_dir: Path, release: threading.Event
) -> None:
    """`train` with overlapped scoring and a server that never answers: SIGINT ends the
    process in seconds (exit 130), not when the request would time out (60 s)."""
    asked = threading.Event()

    def never(request: Received) -> Answer:
        asked.set()
        release.wait(120)
        return -1, b""  # the client is gone: close without an answer

    with fakes.serving(never) as server:
        options = f"url: '{server.url}', protocol: flow_grpo, timeout: 60, retries: 0"
        entry = f"{{name: remote, label: stuck, options: {{{options}}}}}"
        command = [sys.executable, "-m", "mogradient_diffusion.cli", "train", "--preset", "tiny"]
        command += [f"model.path={tiny_pipeline_dir}", f"run.directory={tmp_path / 'run'}"]
        command += ["run.quiet=true", "rollout.overlap_rewards=true", "rollout.batch_size=4"]
        command += ["train.batch_size=4", f"rewards=[{{name: color_match}}, {entry}]"]
        environment = {
            **os.environ,
            "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'diffusion'}",
            "OMP_NUM_THREADS": "1",
        }
        process = subprocess.Popen(command, env=environment, stderr=subprocess.PIPE, text=True)
        try:
            assert asked.wait(90), "the server was never asked"
            process.send_signal(signal.SIGINT)
            sent = time.monotonic()
            assert process.wait(timeout=30) == 130, process.stderr.read()[-3000:]
            assert time.monotonic() - sent < 10
        finally:
            process.kill()
            process.wait(10)
        error = process.stderr.read()
    assert "Traceback" not in error
    assert error.strip().splitlines()[-1].startswith("mogradient-diffusion: interrupted; ")
