"""``serve-reward``'s app under a real uvicorn on 127.0.0.1, in a thread of the test process."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from mogradient_diffusion.rewards import Reward
from mogradient_diffusion.rewards.remote.server import create_app


@contextmanager
def uvicorn_serving(reward: Reward, max_batch: int = 4) -> Iterator[str]:
    """The app serving ``reward`` on a free port; yields its URL, stopped after."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    config = uvicorn.Config(create_app(reward, max_batch), log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]})
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        listener.close()
    assert not thread.is_alive()
