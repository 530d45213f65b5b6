"""A hung reward, Ctrl-C, SIGTERM and running out of GPU memory each end `train` and `eval`
promptly in one line that says what was kept: no traceback, no wait on a stuck thread."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from mogradient_diffusion.cli import main
from mogradient_diffusion.evaluation import evaluate
from mogradient_diffusion.model.policy import Policy
from mogradient_diffusion.rewards import Reward, RewardError, RewardSet, register_reward
from mogradient_diffusion.rewards.base import RewardTimeout
from mogradient_diffusion.training.trainer import Trainer

from .conftest import train_arguments

THIS_MODULE = "reward_modules=[reliability.test_hangs_and_signals]"
RELEASE = threading.Event()  # lets this process's hung rewards return once a test is over
OOM = torch.cuda.OutOfMemoryError(
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB"
)


@register_reward
class Hanging(Reward):
    """Scores ``after`` batches, then hangs (a stuck server, a deadlock), first touching
    ``flag`` and sending its process the signal ``send``, as a user would."""

    name = "hanging"
    value_range = (-math.inf, math.inf)

    def __init__(self, after: int = 0, flag: str | None = None, send: int | None = None):
        super().__init__()
        self.after, self.flag, self.send = after, flag, send

    def score(self, images, prompts, metadata):
        if self.after > 0:
            self.after -= 1
            return torch.zeros(len(prompts))
        if self.flag is not None:
            Path(self.flag).touch()
        if self.send is not None:
            os.kill(os.getpid(), self.send)  # to the process: its main thread handles it
        RELEASE.wait(120)
        return torch.zeros(len(prompts))


class TimingOut(Reward):
    """Raises a TimeoutError of its own (a socket's): a failure, not the reward timeout."""

    name = "timing_out"
    value_range = (-math.inf, math.inf)

    def score(self, images, prompts, metadata):
        raise TimeoutError("read timed out")


class OnWhichThread(Reward):
    """1 where it scores on the main thread, else 0."""

    name = "on_which_thread"
    value_range = (0, 1)

    def score(self, images, prompts, metadata):
        on_main = threading.current_thread() is threading.main_thread()
        return torch.full((len(prompts),), float(on_main))


class Greedy(Reward):
    """Runs out of GPU memory while scoring."""

    name = "greedy"
    value_range = (-math.inf, math.inf)

    def score(self, images, prompts, metadata):
        raise OOM


@pytest.fixture(autouse=True)
def _release_hung_rewards() -> Iterator[None]:
    RELEASE.clear()
    yield
    RELEASE.set()


def _hanging(**options: object) -> str:
    """``rewards=[jpeg, hanging]`` with the hanging reward's ``options``."""
    listed = ", ".join(f"{key}: {value}" for key, value in options.items())
    return f"rewards=[{{name: jpeg_incompressibility}}, {{name: hanging, options: {{{listed}}}}}]"


def _last_line(text: str) -> str:
    assert "Traceback" not in text
    return text.strip().splitlines()[-1]


def _on_call(number: int, action, original):
    """``original``, except that call ``number`` (1-based) runs ``action`` first."""
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(None)
        if len(calls) == number:
            action()
        return original(*args, **kwargs)

    return wrapped


def _raise(error: BaseException):
    def action():
        raise error

    return action


def _checkpoints(run_dir: Path) -> list[str]:
    return sorted(path.name for path in (run_dir / "checkpoints").iterdir())


# ------------------------------------------------------------------ a hung reward
def test_a_reward_is_abandoned_at_its_timeout_and_its_own_errors_are_not_timeouts() -> None:
    images = torch.rand(2, 3, 8, 8)
    started = time.perf_counter()
    with pytest.raises(RewardTimeout, match=r"'hanging' did not finish scoring 2 images within"):
        RewardSet([Hanging()], timeout=0.2)(images, ["a", "b"])
    assert time.perf_counter() - started < 5
    with pytest.raises(RewardError, match="'timing_out' failed: read timed out") as raised:
        RewardSet([TimingOut()], timeout=5)(images, ["a", "b"])
    assert not isinstance(raised.value, RewardTimeout)
    with pytest.raises(RewardError, match=r"'greedy' ran out of GPU memory.*batch_size option"):
        RewardSet([Greedy()])(images, ["a", "b"])
    assert RewardSet([OnWhichThread()]).timeout == 1800  # the default: on a thread of its own
    assert RewardSet([OnWhichThread()])(images, ["a", "b"]).values.sum() == 0
    assert RewardSet([OnWhichThread()], timeout=None)(images, ["a", "b"]).values.sum() == 2


def test_a_hung_reward_stops_training_naming_it_and_its_timeout(
    tmp_path: Path, tiny_pipeline_dir: Path, capsys
) -> None:
    arguments = train_arguments(
        tmp_path, tiny_pipeline_dir, THIS_MODULE, _hanging(after=1),
        "rollout.reward_timeout=1", "rollout.overlap_rewards=true",
    )  # fmt: skip
    started = time.perf_counter()
    assert main(arguments) == 1
    assert time.perf_counter() - started < 60
    line = _last_line(capsys.readouterr().err)
    assert line.startswith("mogradient-diffusion: training stopped: reward 'hanging' did not")
    assert "within 1 s" in line and "raise rollout.reward_timeout" in line
    assert "step_00000001, is intact" in line
    assert _checkpoints(tmp_path) == ["step_00000001"]


def test_a_reward_timeout_of_zero_is_a_config_error(
    tmp_path: Path, tiny_pipeline_dir: Path, capsys, never_load_the_model
) -> None:
    arguments = train_arguments(tmp_path, tiny_pipeline_dir, "rollout.reward_timeout=0")
    assert main(arguments) == 2
    assert "rollout.reward_timeout must be > 0" in _last_line(capsys.readouterr().err)


# ------------------------------------------------------------ signals, in a process
def _cli(*arguments: str, code: str = "") -> subprocess.Popen:
    """``mogradient-diffusion ARGUMENTS`` in a process of its own (after running ``code``)."""
    tests = str(Path(__file__).parents[1])
    environment = {**os.environ, "PYTHONPATH": tests, "OMP_NUM_THREADS": "1"}
    script = f"{code}\nfrom mogradient_diffusion.cli import main\nraise SystemExit(main())"
    command = [sys.executable, "-c", script, *arguments]
    return subprocess.Popen(command, env=environment, stderr=subprocess.PIPE, text=True)


def _wait_for(path: Path, process: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert process.poll() is None, process.stderr.read()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_ctrl_c_while_a_background_reward_hangs_ends_the_process_at_once(
    tmp_path: Path, tiny_pipeline_dir: Path
) -> None:
    run_dir, flag = tmp_path / "run", tmp_path / "hung"
    process = _cli(
        *train_arguments(run_dir, tiny_pipeline_dir, THIS_MODULE, _hanging(after=1, flag=flag)),
        "rollout.overlap_rewards=true",
    )
    try:
        _wait_for(flag, process)
        process.send_signal(signal.SIGINT)
        sent = time.monotonic()
        assert process.wait(timeout=30) == 130  # not after the hung thread
        assert time.monotonic() - sent < 10
    finally:
        process.kill()
    line = _last_line(process.stderr.read())
    assert line == (
        f"mogradient-diffusion: interrupted; the last checkpoint, {run_dir}/checkpoints/"
        "step_00000001, is intact: the same command resumes from it"
    )


def _eval_arguments(model: Path, out: Path) -> list[str]:
    return ["eval", "--model", str(model), "--prompts", "general", "--metrics",
            "jpeg_incompressibility", "--max-prompts", "3", "--batch-size", "1", "--steps",
            "1", "--max-sequence-length", "32", "--quiet", "--out", str(out)]  # fmt: skip


def test_a_second_ctrl_c_while_eval_cleans_up_is_one_line_too(
    tmp_path: Path, tiny_pipeline_dir: Path
) -> None:
    patch = (
        "import signal\n"
        "from mogradient_diffusion.evaluation import evaluate\n"
        "def ctrl_c(original):\n"
        "    def wrapped(*args, **kwargs):\n"
        "        signal.raise_signal(signal.SIGINT)\n"
        "        return original(*args, **kwargs)\n"
        "    return wrapped\n"
        "evaluate.generate = ctrl_c(evaluate.generate)\n"  # the first, while generating
        "evaluate.discard = ctrl_c(evaluate.discard)\n"  # the second, while cleaning up
    )
    out = tmp_path / "out"
    process = _cli(*_eval_arguments(tiny_pipeline_dir, out), code=patch)
    try:
        assert process.wait(timeout=120) == 130
    finally:
        process.kill()
    line = _last_line(process.stderr.read())
    assert line.startswith("mogradient-diffusion: SIGINT again: stopped at once; an unfinished")
    assert f"{out}/.eval-in-progress" in line


# ------------------------------------------------------------ signals, in this process
@pytest.fixture
def sigterm_fails_the_test() -> Iterator[None]:
    """A SIGTERM that reaches Python's default (ending pytest) fails the test instead."""

    def fail(number, frame):
        raise AssertionError("SIGTERM reached the default handler")

    previous = signal.signal(signal.SIGTERM, fail)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_sigterm_in_train_is_one_line_naming_the_checkpoint_like_ctrl_c(
    tmp_path: Path, tiny_pipeline_dir: Path, capsys, sigterm_fails_the_test
) -> None:
    rewards = _hanging(after=1, send=int(signal.SIGTERM))
    assert main(train_arguments(tmp_path, tiny_pipeline_dir, THIS_MODULE, rewards)) == 143
    line = _last_line(capsys.readouterr().err)
    assert line == (
        f"mogradient-diffusion: stopped by SIGTERM; the last checkpoint, {tmp_path}/"
        "checkpoints/step_00000001, is intact: the same command resumes from it"
    )


@pytest.mark.parametrize(
    ("number", "code", "said"),
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "stopped by SIGTERM")],
)
def test_a_signal_in_eval_is_one_line_and_leaves_nothing_half_written(
    tmp_path: Path, tiny_pipeline_dir: Path, capsys, monkeypatch, sigterm_fails_the_test,
    number: int, code: int, said: str,
) -> None:  # fmt: skip
    signalled = _on_call(2, lambda: signal.raise_signal(number), evaluate.generate)
    monkeypatch.setattr(evaluate, "generate", signalled)
    out = tmp_path / "out"
    try:
        assert main(_eval_arguments(tiny_pipeline_dir, out)) == code
    except KeyboardInterrupt:
        pytest.fail("the interrupt left eval as a traceback")
    line = _last_line(capsys.readouterr().err)
    assert line.startswith(f"mogradient-diffusion eval: {said}; nothing is half-written")
    assert not out.exists()


# ------------------------------------------------------------ out of GPU memory
@pytest.mark.parametrize(
    ("owner", "method", "call", "stage", "advice"),
    [
        (Policy, "decode", 2, "while sampling", "lower rollout.batch_size"),
        (Trainer, "optimizer_step_on", 3, "in the training step", "lower train.batch_size"),
    ],
)
def test_out_of_memory_in_train_names_the_stage_what_to_lower_and_the_checkpoint(
    tmp_path: Path, tiny_pipeline_dir: Path, capsys, monkeypatch,
    owner: type, method: str, call: int, stage: str, advice: str,
) -> None:  # fmt: skip
    monkeypatch.setattr(owner, method, _on_call(call, _raise(OOM), getattr(owner, method)))
    assert main(train_arguments(tmp_path, tiny_pipeline_dir)) == 1
    line = _last_line(capsys.readouterr().err)
    assert line.startswith(
        f"mogradient-diffusion: training stopped: out of GPU memory {stage} (tried to "
        f"allocate 2.00 GiB): {advice}"
    )
    assert line.endswith("step_00000001, is intact: the same command resumes from it")


def test_out_of_memory_in_eval_names_the_stage_and_what_to_lower(
    tmp_path: Path, tiny_pipeline_dir: Path, capsys, monkeypatch
) -> None:
    monkeypatch.setattr(evaluate, "generate", _on_call(2, _raise(OOM), evaluate.generate))
    out = tmp_path / "out"
    assert main(_eval_arguments(tiny_pipeline_dir, out)) == 1
    line = _last_line(capsys.readouterr().err)
    assert line.startswith(
        "mogradient-diffusion eval: out of GPU memory while generating (tried to allocate "
        "2.00 GiB): lower --batch-size"
    )
    assert "nothing is half-written" in line and not out.exists()
