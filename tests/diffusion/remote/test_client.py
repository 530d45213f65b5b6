"""The ``remote`` reward against stand-ins of the reference servers on 127.0.0.1: scores as
the server gives them, and every way a server fails ends as one line (required) or NaN,
counted (optional), never as 0."""

from __future__ import annotations

import gzip
import logging
import math
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from mogradient_diffusion.config.settings import ConfigError
from mogradient_diffusion.rewards import REWARDS, RewardSet, make_reward, register_reward
from mogradient_diffusion.rewards.base import to_uint8_images
from mogradient_diffusion.rewards.remote import RemoteReward, RewardServiceError
from mogradient_diffusion.rewards.remote.flow_grpo import FlowGrpo
from mogradient_diffusion.rewards.remote.images import jpeg_bytes
from mogradient_diffusion.training_config import load_config

from . import fakes
from .fakes import Answer, Received

PROMPTS = [f"prompt {i}" for i in range(5)]
FAST = {"retries": 0, "backoff": 0.0, "timeout": 10.0}


def images(count: int = 5, seed: int = 0) -> torch.Tensor:
    return torch.rand(count, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


def expected_means(batch: torch.Tensor) -> torch.Tensor:
    """What the fake servers answer: each image's mean after the JPEG the client sends."""
    jpegs = [jpeg_bytes(image) for image in to_uint8_images(batch)]
    return torch.tensor(fakes.jpeg_means(jpegs), dtype=torch.float32)


@pytest.fixture
def remote() -> Iterator[Callable[..., RemoteReward]]:
    """``remote(**options)``: a ``remote`` reward, closed after the test."""
    made: list[RemoteReward] = []

    def make(**options) -> RemoteReward:
        made.append(make_reward("remote", **options))
        return made[-1]

    yield make
    for reward in made:
        reward.close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_flow_grpo_deqa_batches_and_scores_as_the_server_says(remote) -> None:
    with fakes.serving(fakes.deqa) as server:
        reward = remote(url=server.url, protocol="flow_grpo", batch_size=2)
        scores = reward(images(), PROMPTS)
    assert torch.equal(scores, expected_means(images()))
    assert [request.path for request in server.received] == ["/"] * 3  # 2 + 2 + 1 images


def test_flow_grpo_geneval_reads_scores_and_needs_its_metadata(remote) -> None:
    metadata = [
        {"tag": "counting", "include": [{"class": "cat", "count": 1}] * n} for n in range(5)
    ]
    with fakes.serving(fakes.geneval) as server:
        reward = remote(url=server.url, protocol="flow_grpo", **FAST)
        scores = reward(images(), PROMPTS, metadata)
        assert scores.tolist() == [n / 4 for n in range(5)]
        with pytest.raises(RewardServiceError) as failed:
            reward(images(), PROMPTS)  # no meta_datas: the server's KeyError, as HTTP 500
    message = str(failed.value)
    assert message == (
        f"reward 'remote': {server.url} could not score 5 image(s): "
        "HTTP 500: KeyError: 'meta_datas' (after 1 attempt(s))"
    )


def test_verl_omni_sends_one_image_per_request_and_an_error_answer_fails(remote) -> None:
    prompts = ["a", "b", "fail", "c"]
    with fakes.serving(fakes.verl) as server:
        optional = remote(url=server.url, protocol="verl_omni", required=False, **FAST)
        scores = optional(images(4), prompts)
        requests_for_four_images = len(server.received)
        required = remote(url=server.url, protocol="verl_omni", **FAST)
        with pytest.raises(RewardServiceError, match="reported an error: ValueError: no text"):
            required(images(4), prompts)
    expected = expected_means(images(4))
    expected[2] = math.nan
    assert torch.equal(scores.isnan(), expected.isnan())
    assert torch.equal(scores.nan_to_num(), expected.nan_to_num())
    assert optional.take_failed_samples() == 1 and optional.failed_samples == 0
    # One request an image (the stand-in refuses any other); the required reward may stop
    # sending once the error answer arrives, so only the optional one's count is fixed.
    assert requests_for_four_images == 4


def test_an_openai_judge_scores_final_score_and_never_guesses(remote, monkeypatch) -> None:
    monkeypatch.setenv("TEST_JUDGE_KEY", "sk-judge")

    def reply(body: dict) -> str:
        text = body["messages"][0]["content"][1]["text"]
        return "I am not sure." if "unsure" in text else "Sharp and faithful.\nFinal Score: 4"

    prompts = ["a cat", "unsure dog", "a bird"]
    with fakes.serving(fakes.judge(reply)) as server:
        options = dict(url=server.url + "/v1", protocol="openai_judge", model="judge", **FAST)
        reward = remote(api_key_env="TEST_JUDGE_KEY", required=False, **options)
        scores = reward(images(3), prompts)
        with pytest.raises(RewardServiceError, match=r"no score in \[1, 5\].*I am not sure"):
            remote(**options)(images(3), prompts)
    assert scores[0] == scores[2] == 0.75 and scores[1].isnan()
    assert {request.path for request in server.received} == {"/v1/chat/completions"}
    assert server.received[0].headers["Authorization"] == "Bearer sk-judge"


def test_concurrent_batches_from_several_threads_share_one_bounded_pool(remote) -> None:
    """Several training ranks' worth of batches at once: every score right, and never more
    than ``concurrency`` requests in flight."""

    def slow_deqa(request: Received) -> Answer:
        time.sleep(0.02)
        return fakes.deqa(request)

    results: dict[int, torch.Tensor] = {}
    with fakes.serving(slow_deqa) as server:
        reward = remote(url=server.url, protocol="flow_grpo", batch_size=2, concurrency=3)

        def rank(index: int) -> None:
            for step in range(3):
                seed = index * 10 + step
                results[seed] = reward(images(10, seed=seed), PROMPTS * 2)

        threads = [threading.Thread(target=rank, args=(index,)) for index in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    assert len(results) == 12
    for seed, scores in results.items():
        assert torch.equal(scores, expected_means(images(10, seed=seed)))
    assert len(server.received) == 12 * 4 + 12  # 10 images each: 5 requests of 2
    assert 2 <= server.max_in_flight <= 3


def test_a_server_killed_mid_batch_fails_the_batch_at_once(remote, tmp_path: Path) -> None:
    port = free_port()
    script = Path(fakes.__file__)
    process = subprocess.Popen(
        [sys.executable, str(script), "slow", str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout.readline().startswith("serving")
        reward = remote(
            url=f"http://127.0.0.1:{port}",
            protocol="flow_grpo",
            timeout=30.0,
            retries=1,
            backoff=0.1,
        )
        threading.Timer(0.5, process.kill).start()
        start = time.monotonic()
        with pytest.raises(RewardServiceError) as failed:
            reward(images(), PROMPTS)
        assert time.monotonic() - start < 15  # not the 30 s time-out: the connection dropped
    finally:
        process.kill()
        process.wait(10)
    message = str(failed.value)
    assert f"http://127.0.0.1:{port} could not score 5 image(s): ConnectError" in message
    assert "(after 2 attempt(s))" in message and "\n" not in message


def test_a_slow_answer_times_out_and_the_retry_is_scored(remote) -> None:
    calls = []

    def slow_once(request: Received) -> Answer:
        calls.append(time.monotonic())
        if len(calls) == 1:
            time.sleep(1.5)
        return fakes.deqa(request)

    with fakes.serving(slow_once) as server:
        reward = remote(url=server.url, protocol="flow_grpo", timeout=0.5, retries=2, backoff=0.1)
        scores = reward(images(), PROMPTS)
        assert torch.equal(scores, expected_means(images()))
        assert len(server.received) == 2


def constant(status: int, body: bytes) -> Callable[[Received], Answer]:
    return lambda request: (status, body)


@pytest.mark.parametrize(
    ("answer", "cause", "attempts"),
    [
        (constant(200, b"<html>proxy error</html>"), "the answer is not a pickle", 1),
        (constant(200, pickle.dumps({"outputs": [0.5]})), "answered 1 scores for 5 images", 1),
        (constant(200, pickle.dumps({"outputs": [0.5, math.nan, 0, 0, 0]})), "non-finite", 1),
        (constant(200, pickle.dumps({"outputs": [2.0] * 5})), "outside value_range [0, 1]", 1),
        (constant(404, b"Not Found"), "HTTP 404: Not Found", 1),
        (constant(503, b"Traceback\n  File x\nRuntimeError: no GPU"), "503: RuntimeError", 3),
        (constant(429, b"slow down"), "HTTP 429: slow down (after 3 attempt(s))", 3),
    ],
)
def test_a_bad_answer_is_one_line_naming_reward_and_server(remote, answer, cause, attempts) -> None:
    with fakes.serving(answer) as server:
        options = dict(url=server.url, protocol="flow_grpo", retries=2, backoff=0.01)
        reward = remote(value_range=[0, 1], **options)
        with pytest.raises(RewardServiceError) as failed:
            reward(images(), PROMPTS)
    message = str(failed.value)
    assert message.startswith(f"reward 'remote': {server.url} could not score 5 image(s): ")
    assert cause in message and "\n" not in message
    assert len(server.received) == attempts  # only busy or failing servers are retried


def test_an_optional_reward_scores_nan_never_zero_and_counts(remote, caplog) -> None:
    """Each failed request is logged at debug level only: a dead optional server must not
    flood stderr (the trainer warns once per epoch with the count)."""
    answer = constant(200, pickle.dumps({"outputs": [0.5]}))  # one score for two images
    with fakes.serving(answer) as server, caplog.at_level(logging.DEBUG):
        reward = remote(url=server.url, protocol="flow_grpo", batch_size=2, required=False)
        scores = reward(images(), PROMPTS)
    assert scores[:4].isnan().all() and scores[4] == 0.5  # the last request had one image
    assert reward.failed_samples == 4 and reward.take_failed_samples() == 4
    assert reward.take_failed_samples() == 0
    records = [r for r in caplog.records if r.name.endswith("remote.client")]
    assert len(records) == 2 and all(r.levelno == logging.DEBUG for r in records)
    assert all("scored NaN (required: false)" in r.getMessage() for r in records)


def test_connection_refused_then_a_server_that_comes_back(remote) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    optional = remote(url=url, protocol="flow_grpo", required=False, **FAST)
    required = remote(url=url, protocol="flow_grpo", **FAST)
    assert optional(images(), PROMPTS).isnan().all() and optional.take_failed_samples() == 5
    with pytest.raises(RewardServiceError, match=f"{url} could not score 5 image.*ConnectError"):
        required(images(), PROMPTS)
    with fakes.serving(fakes.deqa, port=port):
        assert torch.equal(optional(images(), PROMPTS), expected_means(images()))
        assert torch.equal(required(images(), PROMPTS), expected_means(images()))
    assert optional.failed_samples == 0


def test_a_malicious_answer_is_refused_without_running_it(remote, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    answer = constant(200, pickle.dumps({"outputs": [0.5] * 5, "x": Payload()}))
    with fakes.serving(answer) as server:
        with pytest.raises(RewardServiceError, match=r"refused to unpickle posix\.system from"):
            remote(url=server.url, protocol="flow_grpo")(images(), PROMPTS)
        optional = remote(url=server.url, protocol="flow_grpo", required=False)
        assert optional(images(), PROMPTS).isnan().all()
    assert not marker.exists()


def test_a_required_failure_stops_a_reward_set_as_itself(remote) -> None:
    reward = remote(url=f"http://127.0.0.1:{free_port()}", protocol="flow_grpo", **FAST)
    with pytest.raises(RewardServiceError, match=r"^reward 'remote': http"):
        RewardSet([reward], timeout=30)(images(), PROMPTS)


def test_options_are_checked_when_the_reward_is_built() -> None:
    cases = [
        ({}, "the option url is required"),
        ({"url": "ftp://x"}, "must be an http\\(s\\) address"),
        ({"url": "http://x", "protocol": "grpc"}, "unknown protocol 'grpc'; choose one of"),
        ({"url": "http://x", "score_key": "a"}, r"\['score_key'\] do not apply to protocol 'ours'"),
        ({"url": "http://x", "protocol": "verl_omni", "batch_size": 4}, "leave batch_size out"),
        ({"url": "http://x", "protocol": "openai_judge"}, "needs the option model"),
        ({"url": "http://x", "protocol": "openai_judge", "api_key": "sk-1"}, "is refused"),
        ({"url": "http://x", "timeout": 0}, "timeout must be a positive"),
        ({"url": "http://x", "retries": -1}, "retries must be"),
        ({"url": "http://x", "concurrency": 0}, "concurrency must be"),
        ({"url": "http://x", "required": "yes"}, "required must be true or false"),
        ({"url": "http://x", "value_range": [1, 0]}, "value_range must be"),
        ({"url": "http://x", "deadline": 0}, "deadline must be a positive number"),
        ({"url": "http://x", "max_response_mib": -1}, "max_response_mib must be a positive"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError, match=f"^remote: .*{message}"):
            make_reward("remote", **options)


def test_a_config_lists_remote_rewards_and_a_subclass_names_a_second_one() -> None:
    remote = "{name: remote, options: {url: 'http://127.0.0.1:18085', protocol: flow_grpo}}"
    config = load_config(preset="tiny", overrides=[f"rewards=[{remote}, {{name: color_match}}]"])
    assert config.rewards[0].options["protocol"] == "flow_grpo"
    with REWARDS.restored():  # two servers in one run: a second name, by a subclass

        @register_reward
        class Deqa(RemoteReward):
            name = "deqa"

        reward = make_reward("deqa", url="http://127.0.0.1:18086", protocol="flow_grpo")
        assert reward.name == "deqa" and reward.endpoint == "http://127.0.0.1:18086"
        reward.close()


def test_a_corrupt_gzip_answer_fails_once_and_is_not_retried(remote) -> None:
    """httpx's DecodingError is a RequestError but no TransportError: it escaped ``_post``
    as a bare httpx exception."""
    answer = lambda request: (200, b"not gzip at all", {"Content-Encoding": "gzip"})  # noqa: E731
    with fakes.serving(answer) as server:
        options = dict(url=server.url, protocol="flow_grpo", retries=2, backoff=0.01)
        with pytest.raises(RewardServiceError) as failed:
            remote(**options)(images(), PROMPTS)
        assert len(server.received) == 1  # the same answer would come again
        optional = remote(required=False, **options)
        assert optional(images(), PROMPTS).isnan().all()
        assert optional.take_failed_samples() == 5
    message = str(failed.value)
    assert message.startswith(f"reward 'remote': {server.url} could not score 5 image(s): ")
    assert "DecodingError" in message and "\n" not in message


def test_any_error_reading_an_answer_is_one_failed_request(remote, monkeypatch) -> None:
    """An integer past a float's range (OverflowError before), or any other exception a
    protocol raises on an untrusted answer, fails the request in one line."""
    huge = constant(200, pickle.dumps({"outputs": [10**400] * 5}))
    with fakes.serving(huge) as server, pytest.raises(RewardServiceError) as failed:
        remote(url=server.url, protocol="flow_grpo", **FAST)(images(), PROMPTS)
    assert str(failed.value).endswith("an integer of 1329 bits is too large for a float")

    def broken(self, body, source):
        raise RecursionError("Traceback ...\nmaximum recursion depth exceeded")

    monkeypatch.setattr(FlowGrpo, "decode", broken)
    with fakes.serving(fakes.deqa) as server:
        with pytest.raises(RewardServiceError) as failed:
            remote(url=server.url, protocol="flow_grpo", **FAST)(images(), PROMPTS)
        optional = remote(url=server.url, protocol="flow_grpo", required=False, **FAST)
        assert optional(images(), PROMPTS).isnan().all()
    assert str(failed.value).endswith(
        "could not score 5 image(s): the answer could not be read "
        "(RecursionError: maximum recursion depth exceeded)"
    )


def test_an_answer_past_max_response_mib_is_refused_compressed_or_not(remote) -> None:
    """The body is read at most ``max_response_mib`` deep, decompressed: a small gzip of
    zeros may not expand in the trainer's memory."""
    plain = constant(200, bytes(3 * 2**20))
    bomb = gzip.compress(bytes(3 * 2**20))
    assert len(bomb) < 2**20 / 10
    zipped = lambda request: (200, bomb, {"Content-Encoding": "gzip"})  # noqa: E731
    for answer in (plain, zipped):
        with fakes.serving(answer) as server:
            reward = remote(url=server.url, protocol="flow_grpo", max_response_mib=1, retries=2)
            with pytest.raises(RewardServiceError) as failed:
                reward(images(), PROMPTS)
            assert len(server.received) == 1
        assert str(failed.value).endswith(
            "could not score 5 image(s): the answer is larger than max_response_mib (1 MiB)"
        )


@pytest.fixture
def hung_server() -> Iterator[fakes.FakeServer]:
    """A server that takes every request and never answers (until the test is over)."""
    release = threading.Event()

    def never(request: Received) -> Answer:
        release.wait(60)
        return -1, b""

    with fakes.serving(never) as server:
        try:
            yield server
        finally:
            release.set()


def test_a_hung_optional_server_costs_its_deadline_not_the_run(remote, hung_server) -> None:
    """The remote reward's worst case (30 s x 4 attempts, 5 requests 2 at a time) is far
    beyond the reward set's timeout (10 s): without its own deadline it hit the reward set's
    RewardTimeout, which stops training even for an optional reward."""
    options = dict(url=hung_server.url, protocol="flow_grpo", batch_size=1, concurrency=2)
    options |= dict(timeout=30.0, retries=3, backoff=0.01, deadline=0.5)
    optional = remote(required=False, **options)
    started = time.monotonic()
    values = RewardSet([optional], timeout=10)(images(), PROMPTS).values
    assert time.monotonic() - started < 5
    assert values.isnan().all() and optional.take_failed_samples() == 5

    required = remote(**options)
    started = time.monotonic()
    with pytest.raises(RewardServiceError) as failed:
        RewardSet([required], timeout=10)(images(), PROMPTS)
    assert time.monotonic() - started < 5
    assert str(failed.value) == (
        f"reward 'remote': {hung_server.url} could not score 1 image(s): no scores within "
        "the deadline of 0.5 s (abandoned)"
    )


def test_a_deadline_not_below_the_reward_timeout_is_refused_at_start_up() -> None:
    def remote_entry(options: str = "") -> str:
        return f"rewards=[{{name: remote, label: slow, options: {{url: 'http://x'{options}}}}}]"

    with pytest.raises(ConfigError) as refused:
        load_config(preset="tiny", overrides=[remote_entry(", deadline: 1800")])
    assert str(refused.value) == (
        "reward 'slow': its deadline, 1800 s, must be below rollout.reward_timeout (1800 s), "
        "so that a server that stops answering fails as its required option says; lower the "
        "deadline option or raise rollout.reward_timeout"
    )
    with pytest.raises(ConfigError, match=r"its deadline, 1500 s \(its default\), must be"):
        load_config(preset="tiny", overrides=[remote_entry(), "rollout.reward_timeout=600"])
    for deadline, limit in [(500, 600), (1e6, "null")]:
        overrides = [remote_entry(f", deadline: {deadline}"), f"rollout.reward_timeout={limit}"]
        assert load_config(preset="tiny", overrides=overrides).rewards[0].label == "slow"


@pytest.mark.timeout(180)  # a process of its own, importing torch
def test_httpx_is_imported_by_the_first_remote_reward_only() -> None:
    """Runs without a remote reward never load httpx (still a dependency)."""
    script = (
        "import sys\n"
        "import mogradient_diffusion.cli, mogradient_diffusion.training.trainer\n"
        "from mogradient_diffusion.rewards import make_reward\n"
        "print('httpx' in sys.modules)\n"
        "make_reward('remote', url='http://127.0.0.1:9').close()\n"
        "print('httpx' in sys.modules)\n"
    )
    root = Path(__file__).resolve().parents[3]
    environment = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{root / 'diffusion'}"}
    result = subprocess.run(
        [sys.executable, "-c", script], env=environment, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "True"]
