"""``serve-reward``: any registered reward served over our protocol (``ours.py``).

Built on FastAPI and uvicorn (the ``serve`` extra): both are well kept; uvicorn's event loop
holds many clients' connections while scoring runs on worker threads; pydantic checks each
request's shape before any image is decoded; and they are what Flow-Factory, UniRL and
cosmos-rl serve their rewards with. Flask under gunicorn (Flow-GRPO's reward-server) needs a
sync worker process per request in flight.

One batch is scored at a time (a lock): a reward is not assumed to be thread-safe, and a
model on one GPU scores one batch at a time at its fastest anyway. Images are decoded
outside the lock, so the next request is ready when the current one ends.
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import numpy as np
import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from ..base import Reward
from .images import decode_png_base64
from .ours import VERSION
from .protocol import quote

logger = logging.getLogger(__name__)


class ScoreRequest(BaseModel):
    """The body of ``POST /score``."""

    model_config = ConfigDict(extra="forbid")

    version: Literal[1]
    images: list[str]
    prompts: list[str]
    metadata: list[dict[str, Any]] | None = None


class BadRequest(ValueError):
    """A request that is well-formed JSON but cannot be scored as it is (a 400)."""


def create_app(reward: Reward, max_batch: int = 16) -> FastAPI:
    """The app serving ``reward``, ``max_batch`` images per call at most; no server is
    started (``serve`` runs it under uvicorn, tests under their own)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    app = FastAPI(title=f"reward {reward.name}", version=str(VERSION))
    scoring = threading.Lock()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
        problems = error.errors()
        first = problems[0] if problems else {"loc": (), "msg": "invalid request"}
        where = ".".join(str(part) for part in first.get("loc", ())[1:]) or "body"
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        message = f"{where}: {first.get('msg')}{more}"
        logger.info("reward %s: invalid request, 422: %s", reward.name, message)
        return JSONResponse({"error": message}, status_code=422)

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "rewards": [reward.name], "version": VERSION}

    @app.post("/score")
    def score(request: ScoreRequest) -> JSONResponse:  # sync: FastAPI runs it on a thread
        start = time.perf_counter()
        try:
            images = _images(request)
            with scoring, torch.no_grad():
                scores = _scores(reward, images, request, max_batch)
            status, body = 200, {"version": VERSION, "scores": scores}
        except BadRequest as error:
            status, body = 400, {"error": str(error)}
        except Exception as error:  # the reward's own failure: named, and logged in full
            logger.exception("reward %s raised", reward.name)
            status, body = 500, {"error": f"reward {reward.name!r} failed: {_one_line(error)}"}
        seconds = time.perf_counter() - start
        count = len(request.images)
        logger.info("reward %s: %d images, %.3f s, %d", reward.name, count, seconds, status)
        return JSONResponse(body, status_code=status)

    return app


def _images(request: ScoreRequest) -> torch.Tensor:
    """The request's images as [B, 3, H, W] floats in [0, 1]; BadRequest if they are not
    as many as the prompts (and metadata), not PNG, or not all of one size."""
    count = len(request.prompts)
    if len(request.images) != count:
        raise BadRequest(f"{len(request.images)} images but {count} prompts")
    if request.metadata is not None and len(request.metadata) != count:
        raise BadRequest(f"{len(request.metadata)} metadata entries but {count} prompts")
    arrays = []
    for index, text in enumerate(request.images):
        try:
            arrays.append(decode_png_base64(text))
        except ValueError as error:
            raise BadRequest(f"image {index}: {error}") from None
    if len({array.shape for array in arrays}) > 1:
        raise BadRequest("the images of one request must all have the same size")
    if not arrays:
        return torch.empty(0, 3, 0, 0)
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float() / 255


def _scores(
    reward: Reward, images: torch.Tensor, request: ScoreRequest, max_batch: int
) -> list[float | None]:
    """``reward`` on the images, ``max_batch`` at a time; NaN (not applicable) as None."""
    scores: list[float | None] = []
    for i in range(0, len(request.prompts), max_batch):
        metadata = None if request.metadata is None else request.metadata[i : i + max_batch]
        values = reward(images[i : i + max_batch], request.prompts[i : i + max_batch], metadata)
        scores += [None if math.isnan(value) else value for value in values.tolist()]
    return scores


def _one_line(error: Exception) -> str:
    """``Type: first line of the message``: what a client's log line can hold."""
    lines = str(error).strip().splitlines()
    return quote(f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__)


def serve(reward: Reward, host: str, port: int, max_batch: int) -> None:
    """Serve ``reward`` until interrupted; one log line per request."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    app = create_app(reward, max_batch)
    uvicorn.run(app, host=host, port=port, access_log=False, log_level="info")


@contextmanager
def serving_in_thread(reward: Reward, max_batch: int = 16, start_s: float = 60.0) -> Iterator[str]:
    """``serve-reward``'s app for ``reward`` under uvicorn on a free port of 127.0.0.1, in a
    thread of this process; yields its URL and stops the server after.

    For tests, benchmarks and notebooks: a served reward without a second process."""
    import uvicorn

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(reward, max_batch), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + start_s
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError(f"the server of reward {reward.name!r} did not start")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        listener.close()
    if thread.is_alive():
        raise RuntimeError(f"the server of reward {reward.name!r} did not stop in 30 s")
