"""Stand-ins for the reference reward servers, stdlib only (run in a thread, or as a script
in a process of its own that a test can kill): they unpickle with plain ``pickle``, as
Flow-GRPO's reward-server and VeRL-Omni's scorers do.

``python fakes.py slow PORT``: a Flow-GRPO-protocol server that takes 60 s per answer.
"""

from __future__ import annotations

import io
import json
import pickle
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
from PIL import Image

# HTTP status, body, and optionally headers beside Content-Length
Answer = tuple[int, bytes] | tuple[int, bytes, dict[str, str]]


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class FakeServer:
    """A server's address and what it received; ``answer(request)`` decides each answer."""

    url: str
    answer: Callable[[Received], Answer]
    received: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    in_flight: int = 0
    max_in_flight: int = 0


def _handler(fake: FakeServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            request = Received(self.path, dict(self.headers), body)
            with fake.lock:
                fake.received.append(request)
                fake.in_flight += 1
                fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
            try:
                status, answer, *headers = fake.answer(request)
            finally:
                with fake.lock:
                    fake.in_flight -= 1
            if status < 0:  # die mid-answer: close the connection without a response
                self.close_connection = True
                return
            self.send_response(status)
            self.send_header("Content-Length", str(len(answer)))
            for name, value in (headers[0] if headers else {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: object) -> None:  # quiet
            pass

    return Handler


@contextmanager
def serving(answer: Callable[[Received], Answer], port: int = 0) -> Iterator[FakeServer]:
    """A stdlib HTTP server on 127.0.0.1 (``port`` 0: a free one) in a thread, stopped and
    closed on leaving the block."""
    fake = FakeServer("", answer)
    server = ThreadingHTTPServer(("127.0.0.1", port), _handler(fake))
    server.daemon_threads = True
    fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def jpeg_means(images: list[bytes]) -> list[float]:
    """Each JPEG's mean pixel in [0, 1]: the fake servers' score."""
    pixels = [np.asarray(Image.open(io.BytesIO(data), formats=["jpeg"])) for data in images]
    return [float(array.mean() / 255) for array in pixels]


def deqa(request: Received) -> Answer:
    """Flow-GRPO's DeQA server: ``{"images"}`` in, ``{"outputs"}`` out."""
    data = pickle.loads(request.body)
    return 200, pickle.dumps({"outputs": jpeg_means(data["images"])})


GROUPS = ["single_object", "two_object", "counting", "colors", "position", "color_attr"]


def geneval(request: Received) -> Answer:
    """Flow-GRPO's GenEval server: needs ``meta_datas`` and ``only_strict`` (a KeyError is a
    500 with the traceback's text, as in reward-server); ``scores`` is partial credit."""
    try:
        data = pickle.loads(request.body)
        metadata, strict = data["meta_datas"], data["only_strict"]
    except Exception as error:
        last = f"{type(error).__name__}: {error}"
        text = f"Traceback (most recent call last):\n  File app_geneval.py, line 34\n{last}"
        return 500, text.encode()
    scores = [len(item["include"]) / 4 for item in metadata]
    correct = [float(score == 1.0) for score in scores]
    tags = [item["tag"] for item in metadata]
    groups = {
        g: [c if t == g else -10.0 for c, t in zip(correct, tags, strict=True)] for g in GROUPS
    }
    answer = {
        "scores": scores,
        "rewards": [0.0 if strict else c for c in correct],
        "strict_rewards": correct,
        "group_rewards": groups,
        "group_strict_rewards": groups,
    }
    return 200, pickle.dumps(answer)


def verl(request: Received) -> Answer:
    """A VeRL-Omni HTTP scorer: one image; the prompt ``fail`` gets ``{"error"}``."""
    data = pickle.loads(request.body)
    assert len(data["images"]) == 1 and isinstance(data["metadata"], dict)
    if data["prompts"] == ["fail"]:
        return 200, pickle.dumps({"error": "Traceback ...\nValueError: no text found"})
    return 200, pickle.dumps({"scores": jpeg_means(data["images"])})


def judge(reply: Callable[[dict], str]) -> Callable[[Received], Answer]:
    """An OpenAI-compatible chat server whose message content is ``reply(request_json)``."""

    def answer(request: Received) -> Answer:
        body = json.loads(request.body)
        message = {"role": "assistant", "content": reply(body)}
        completion = {"choices": [{"index": 0, "message": message}]}
        return 200, json.dumps(completion).encode()

    return answer


def slow(request: Received) -> Answer:
    time.sleep(60)
    return deqa(request)


if __name__ == "__main__":
    kind, port = sys.argv[1], int(sys.argv[2])
    with serving({"slow": slow, "deqa": deqa}[kind], port) as running:
        print(f"serving {running.url}", flush=True)
        threading.Event().wait()
