"""UnifiedReward client against a local stand-in for the VLM server (loopback HTTP only)."""

from __future__ import annotations

import base64
import io
import json
import re
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from mogradient_diffusion.rewards.base import RewardError
from mogradient_diffusion.rewards.local_weights import MissingWeightsError
from mogradient_diffusion.rewards.registry import make_reward
from mogradient_diffusion.rewards.unified_reward import (
    API_KEY_ENV,
    DEFAULT_QUESTION,
    UnifiedReward,
    final_score,
)

CAPTION = re.compile(r"Text Caption: \[(.*)\]\s*$", re.DOTALL)
# Test prompts carry the score the fake judge should give: "... score=3.5".
SCORE_IN_CAPTION = re.compile(r"score=([0-9.]+)")

Reply = tuple[int, str]  # (HTTP status, message content or raw error body)


@dataclass
class RecordedRequest:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class FakeVlmServer:
    """Test double of an OpenAI-compatible UnifiedReward server: records every request and
    answers with ``respond(request) -> (status, text)``; status 200 wraps ``text`` in a chat
    completion, any other status sends ``text`` as the error body."""

    base_url: str
    respond: Callable[[RecordedRequest], Reply]
    requests: list[RecordedRequest] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    in_flight: int = 0
    max_in_flight: int = 0


def caption_of(request: RecordedRequest) -> str:
    text = request.body["messages"][0]["content"][1]["text"]
    match = CAPTION.search(text)
    assert match, text
    return match.group(1)


def score_from_caption(request: RecordedRequest) -> Reply:
    match = SCORE_IN_CAPTION.search(caption_of(request))
    assert match
    return 200, f"The image fits the caption well.\nFinal Score: {match.group(1)}"


def decoded_image(request: RecordedRequest) -> Image.Image:
    url = request.body["messages"][0]["content"][0]["image_url"]["url"]
    prefix = "data:image;base64,"
    assert url.startswith(prefix)
    image = Image.open(io.BytesIO(base64.b64decode(url[len(prefix) :])))
    assert image.format == "PNG"
    return image


@pytest.fixture(autouse=True)
def _no_proxy_or_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loopback requests must not be routed through a proxy; no ambient API key."""
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("ALL_PROXY", raising=False)
    monkeypatch.delenv(API_KEY_ENV, raising=False)


@pytest.fixture
def server() -> Iterator[FakeVlmServer]:
    """A FakeVlmServer on 127.0.0.1 (free port) in a background thread; shut down after."""
    state: FakeVlmServer | None = None

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            assert state is not None
            length = int(self.headers["Content-Length"])
            request = RecordedRequest(
                self.path, dict(self.headers.items()), json.loads(self.rfile.read(length))
            )
            with state.lock:
                state.requests.append(request)
                state.in_flight += 1
                state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                status, text = state.respond(request)
            finally:
                with state.lock:
                    state.in_flight -= 1
            if status == 200:
                payload = {"choices": [{"message": {"role": "assistant", "content": text}}]}
                data = json.dumps(payload).encode()
            else:
                data = text.encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (timeout test)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05})
    thread.daemon = True
    thread.start()
    state = FakeVlmServer(f"http://127.0.0.1:{httpd.server_address[1]}/v1", score_from_caption)
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def solid_images(levels: list[int], size: int = 24) -> torch.Tensor:
    """[B, 3, size, size] grey images in [0, 1], image i at grey level levels[i]."""
    return (
        torch.tensor(levels, dtype=torch.float32).view(-1, 1, 1, 1).expand(-1, 3, size, size) / 255
    )


def reward_for(server: FakeVlmServer, **options: Any) -> UnifiedReward:
    options.setdefault("backoff", 0.0)
    options.setdefault("timeout", 5.0)
    options.setdefault("base_url", server.base_url)
    return UnifiedReward(**options)


def test_request_format(server: FakeVlmServer) -> None:
    reward = reward_for(server, model="judge-model")
    scores = reward(solid_images([200], size=40), ["a red cube score=4"])
    assert scores.tolist() == pytest.approx([0.8])
    [request] = server.requests
    assert request.path == "/v1/chat/completions"
    assert request.headers["Content-Type"] == "application/json"
    assert "Authorization" not in request.headers
    body = request.body
    assert body["model"] == "judge-model"
    assert body["temperature"] == 0
    [message] = body["messages"]
    assert message["role"] == "user"
    image_part, text_part = message["content"]
    assert image_part["type"] == "image_url" and text_part["type"] == "text"
    image = decoded_image(request)
    assert image.size == (512, 512)
    assert np.abs(np.asarray(image.convert("RGB"), dtype=np.int16) - 200).max() <= 1
    question = text_part["text"]
    assert question.startswith("<image>")
    assert "Final Score:" in question
    assert question.endswith("Text Caption: [a red cube score=4]")
    assert question == DEFAULT_QUESTION.replace("{prompt}", "a red cube score=4")


def test_options_reach_the_request(server: FakeVlmServer) -> None:
    question = "<image> Rate it. Final Score: 1-5. Caption: {prompt} score=2"
    reward = reward_for(server, image_size=64, question=question, base_url=server.base_url + "/")
    server.respond = lambda request: (200, "Final Score: 2")
    assert reward(solid_images([10]), ["a dog"]).tolist() == pytest.approx([0.4])
    [request] = server.requests
    assert request.path == "/v1/chat/completions"
    assert decoded_image(request).size == (64, 64)
    assert request.body["messages"][0]["content"][1]["text"] == (
        "<image> Rate it. Final Score: 1-5. Caption: a dog score=2"
    )


def test_batch_scores_in_order_across_workers(server: FakeVlmServer) -> None:
    values = ["1", "5", "2.5", "4", "3", "1.5", "4.75", "2"]
    prompts = [f"prompt {i} score={v}" for i, v in enumerate(values)]
    levels = [30 * i for i in range(len(values))]
    both_running = threading.Barrier(2, timeout=2)
    first_two: list[str] = []

    def respond(request: RecordedRequest) -> Reply:
        # The first two requests wait for each other: passes only if they run concurrently;
        # the second then finishes first, so replies arrive out of order.
        with server.lock:
            rank = len(first_two)
            if rank < 2:
                first_two.append(caption_of(request))
        if rank < 2:
            both_running.wait()
            if rank == 0:
                threading.Event().wait(0.05)
        return score_from_caption(request)

    server.respond = respond
    reward = reward_for(server, workers=4)
    scores = reward(solid_images(levels), prompts)
    assert scores.dtype == torch.float32
    assert scores.tolist() == pytest.approx([float(v) / 5 for v in values])
    assert server.max_in_flight >= 2
    # Each request pairs the right image with its caption.
    for request in server.requests:
        index = int(caption_of(request).split()[1])
        pixels = np.asarray(decoded_image(request).convert("RGB"), dtype=np.int16)
        assert np.abs(pixels - levels[index]).max() <= 1


def test_batch_size_chunks_the_batch(server: FakeVlmServer) -> None:
    reward = reward_for(server, batch_size=2)
    chunks: list[int] = []
    original = reward.score

    def recording_score(images, prompts, metadata):
        chunks.append(len(prompts))
        return original(images, prompts, metadata)

    reward.score = recording_score  # type: ignore[method-assign]
    prompts = [f"p{i} score={i + 1}" for i in range(5)]
    scores = reward(solid_images([0, 50, 100, 150, 250]), prompts)
    assert chunks == [2, 2, 1]
    assert scores.tolist() == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert len(server.requests) == 5


def test_reply_without_score_raises(server: FakeVlmServer) -> None:
    server.respond = lambda request: (200, "A lovely picture of a cat, I would say good.")
    reward = reward_for(server, retries=2)
    with pytest.raises(RewardError, match=r"unified_reward.*A lovely picture of a cat"):
        reward(solid_images([0]), ["a cat"])
    assert len(server.requests) == 1  # a deterministic reply is not retried


def test_out_of_scale_score_raises(server: FakeVlmServer) -> None:
    server.respond = lambda request: (200, "Final Score: 5.5")
    with pytest.raises(RewardError, match=r"unified_reward.*5\.5"):
        reward_for(server)(solid_images([0]), ["a cat"])


def test_reply_that_is_not_a_chat_completion_raises() -> None:
    reward = UnifiedReward(base_url="http://127.0.0.1:1/v1")
    reward._post = lambda body: b'{"error": "nope"}'  # type: ignore[method-assign]
    with pytest.raises(RewardError, match=r"unified_reward.*did not return a chat completion"):
        reward(solid_images([0]), ["a cat"])


def test_http_500_is_retried_then_raises(server: FakeVlmServer) -> None:
    server.respond = lambda request: (500, '{"error": "engine overloaded"}')
    reward = reward_for(server, retries=2)
    with pytest.raises(RewardError) as info:
        reward(solid_images([0]), ["a cat"])
    message = str(info.value)
    assert "unified_reward" in message
    assert f"{server.base_url}/chat/completions" in message
    assert "500" in message and "engine overloaded" in message
    assert len(server.requests) == 3


def test_transient_500_recovers(server: FakeVlmServer) -> None:
    def respond(request: RecordedRequest) -> Reply:
        if len(server.requests) == 1:
            return 503, "warming up"
        return 200, "Final Score: 3"

    server.respond = respond
    assert reward_for(server, retries=1)(solid_images([0]), ["x"]).tolist() == pytest.approx([0.6])
    assert len(server.requests) == 2


def test_client_error_is_not_retried(server: FakeVlmServer) -> None:
    server.respond = lambda request: (404, '{"error": "model not found"}')
    with pytest.raises(RewardError, match=r"unified_reward.*404.*model not found"):
        reward_for(server, retries=3)(solid_images([0]), ["a cat"])
    assert len(server.requests) == 1


def test_timeout_raises(server: FakeVlmServer) -> None:
    def slow(request: RecordedRequest) -> Reply:
        threading.Event().wait(0.5)
        return 200, "Final Score: 3"

    server.respond = slow
    reward = reward_for(server, timeout=0.1, retries=0)
    with pytest.raises(RewardError, match=r"unified_reward.*after 1 attempt"):
        reward(solid_images([0]), ["a cat"])


def test_connection_refused_raises() -> None:
    with socket.socket() as probe:  # a loopback port that was free a moment ago
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    reward = UnifiedReward(base_url=url, retries=1, backoff=0.0, timeout=2.0)
    with pytest.raises(RewardError) as info:
        reward(solid_images([0, 1]), ["a", "b"])
    message = str(info.value)
    assert "unified_reward" in message and f"{url}/chat/completions" in message
    assert "after 2 attempt(s)" in message


def test_missing_base_url_says_how_to_serve() -> None:
    with pytest.raises(MissingWeightsError, match="unified_reward") as info:
        UnifiedReward()
    message = str(info.value)
    assert "vllm serve CodeGoat24/UnifiedReward-qwen-7b --port 17140" in message
    assert "base_url=http://127.0.0.1:17140/v1" in message
    with pytest.raises(MissingWeightsError, match="vllm serve"):
        make_reward("unified_reward")


def test_bad_options_raise() -> None:
    with pytest.raises(ValueError, match="http"):
        UnifiedReward(base_url="127.0.0.1:17140/v1")
    with pytest.raises(ValueError, match="prompt"):
        UnifiedReward(base_url="http://127.0.0.1:1/v1", question="no placeholder")
    with pytest.raises(ValueError, match="workers"):
        UnifiedReward(base_url="http://127.0.0.1:1/v1", workers=0)


def test_api_key_sent_as_bearer(server: FakeVlmServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "sk-from-env")
    monkeypatch.setenv("MY_JUDGE_KEY", "sk-named")
    reward_for(server)(solid_images([0]), ["a score=3"])
    reward_for(server, api_key_env="MY_JUDGE_KEY")(solid_images([0]), ["a score=3"])
    assert [r.headers.get("Authorization") for r in server.requests] == [
        "Bearer sk-from-env",
        "Bearer sk-named",
    ]


def test_a_literal_api_key_is_refused() -> None:
    with pytest.raises(ValueError, match=API_KEY_ENV):
        UnifiedReward(base_url="http://127.0.0.1:1/v1", api_key="sk-literal")
    with pytest.raises(ValueError, match="environment variable MY_JUDGE_KEY"):
        UnifiedReward(base_url="http://127.0.0.1:1/v1", api_key="sk-x", api_key_env="MY_JUDGE_KEY")
    with pytest.raises(ValueError, match="api_key_env") as info:
        UnifiedReward(base_url="http://127.0.0.1:1/v1", api_key_env="sk-pasted-key")
    assert "sk-pasted-key" not in str(info.value)


def test_registered_and_empty_batch(server: FakeVlmServer) -> None:
    reward = make_reward("unified_reward", base_url=server.base_url)
    assert isinstance(reward, UnifiedReward)
    assert reward.value_range == (0.2, 1.0)
    assert reward(torch.zeros(0, 3, 8, 8), []).shape == (0,)
    assert server.requests == []


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("Final Score: 4", 4.0),
        ("Reasoning...\nFinal Score:3.25 overall", 3.25),
        ("Final Score: 2 then Final Score: 5", 2.0),
        ("final score: 4", None),
        ("Final Score: 0", None),
        ("Score: 4", None),
    ],
)
def test_final_score(reply: str, expected: float | None) -> None:
    assert final_score(reply) == expected
