"""``serve-reward``'s server: the app on its own (FastAPI's TestClient), under a real uvicorn
on 127.0.0.1, and started by the command line; a served reward scores as in process."""

from __future__ import annotations

import base64
import io
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("fastapi", reason="the serve extra is not installed")
pytest.importorskip("uvicorn", reason="the serve extra is not installed")

from fastapi.testclient import TestClient

from mogradient_diffusion import cli
from mogradient_diffusion.rewards import Reward, make_reward
from mogradient_diffusion.rewards.base import to_uint8_images
from mogradient_diffusion.rewards.remote.images import png_base64
from mogradient_diffusion.rewards.remote.server import create_app, serving_in_thread

ROOT = Path(__file__).resolve().parents[3]
PROMPTS = [f"a photo {i}" for i in range(7)]


def images(count: int = 7, seed: int = 0) -> torch.Tensor:
    return torch.rand(count, 3, 24, 24, generator=torch.Generator().manual_seed(seed))


def body(batch: torch.Tensor, prompts: list[str], **extra) -> dict:
    encoded = [png_base64(image) for image in to_uint8_images(batch)]
    return {"version": 1, "images": encoded, "prompts": prompts, **extra}


class Recording(Reward):
    """The mean pixel, NaN for prompts containing "n/a"; raises for "boom"; records calls."""

    name = "recording"
    value_range = (0.0, 1.0)

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []

    def score(self, images, prompts, metadata):
        self.calls.append(len(prompts))
        if any("boom" in prompt for prompt in prompts):
            raise RuntimeError("the model fell over\nsecond line")
        means = images.mean(dim=(1, 2, 3))
        return torch.where(torch.tensor(["n/a" in p for p in prompts]), math.nan, means)


def test_the_app_scores_in_chunks_and_sends_not_applicable_as_null(caplog) -> None:
    reward = Recording()
    client = TestClient(create_app(reward, max_batch=3))
    assert client.get("/health").json() == {"status": "ok", "rewards": ["recording"], "version": 1}
    prompts = [*PROMPTS[:6], "n/a"]
    with caplog.at_level(logging.INFO, logger="mogradient_diffusion.rewards.remote.server"):
        answer = client.post("/score", json=body(images(), prompts))
    assert answer.status_code == 200 and reward.calls == [3, 3, 1]
    scores = answer.json()["scores"]
    assert scores[-1] is None
    expected = images()[:6].mul(255).round().div(255).mean(dim=(1, 2, 3))
    assert np.allclose(scores[:6], expected.tolist(), atol=1e-6)
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("reward recording: 7 images, ")
    assert lines[0].endswith(", 200")


@pytest.mark.parametrize(
    ("request_body", "status", "error"),
    [
        ({"version": 2, "images": [], "prompts": []}, 422, "version: Input should be 1"),
        ({"version": 1, "images": []}, 422, "prompts: Field required"),
        ({"version": 1, "images": [], "prompts": [], "typo": 1}, 422, "typo: Extra inputs"),
        ({"version": 1, "images": ["aGk="], "prompts": []}, 400, "1 images but 0 prompts"),
        ({"version": 1, "images": ["%%%"], "prompts": ["x"]}, 400, "image 0: not a base64 PNG"),
        ({"version": 1, "images": ["aGk="], "prompts": ["x"]}, 400, "image 0: not a base64 PNG"),
        (
            {"version": 1, "images": ["aGk="], "prompts": ["x"], "metadata": [{}, {}]},
            400,
            "2 metadata entries but 1 prompts",
        ),
    ],
)
def test_a_malformed_request_is_a_4xx_with_one_json_error(request_body, status, error) -> None:
    answer = TestClient(create_app(Recording())).post("/score", json=request_body)
    assert answer.status_code == status
    assert error in answer.json()["error"] and "\n" not in answer.json()["error"]


def test_images_of_two_sizes_and_non_json_bodies_are_refused() -> None:
    client = TestClient(create_app(Recording()))
    mixed = body(images(1), ["a"])
    small = Image.new("RGB", (8, 8))
    buffer = io.BytesIO()
    small.save(buffer, format="PNG")
    mixed["images"].append(base64.b64encode(buffer.getvalue()).decode())
    mixed["prompts"].append("b")
    answer = client.post("/score", json=mixed)
    assert answer.status_code == 400 and "same size" in answer.json()["error"]
    answer = client.post(
        "/score", content=b"not json", headers={"Content-Type": "application/json"}
    )
    assert answer.status_code == 422 and "JSON" in answer.json()["error"]


def test_a_reward_that_raises_is_a_500_naming_it(caplog) -> None:
    client = TestClient(create_app(Recording()))
    with caplog.at_level(logging.INFO):
        answer = client.post("/score", json=body(images(2), ["fine", "boom"]))
    assert answer.status_code == 500
    assert answer.json() == {
        "error": "reward 'recording' failed: RuntimeError: the model fell over"
    }
    assert any(record.getMessage().endswith(", 500") for record in caplog.records)


def test_a_served_reward_scores_as_in_process_under_concurrent_callers() -> None:
    """PNG is lossless: the served jpeg_incompressibility sees the same pixels, so its scores
    are the in-process ones exactly, for batches sent from several threads at once."""
    local = make_reward("jpeg_incompressibility")
    results: dict[int, torch.Tensor] = {}
    with serving_in_thread(make_reward("jpeg_incompressibility"), max_batch=4) as url:
        remote = make_reward("remote", url=url, batch_size=3, concurrency=4)

        def rank(seed: int) -> None:
            results[seed] = remote(images(seed=seed), PROMPTS)

        try:
            threads = [threading.Thread(target=rank, args=(seed,)) for seed in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
        finally:
            remote.close()
    assert sorted(results) == [0, 1, 2, 3]
    for seed, scores in results.items():
        assert torch.equal(scores, local(images(seed=seed), PROMPTS))


RANK_SCRIPT = """
import json, sys, torch
from mogradient_diffusion.rewards import make_reward
url, rank, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
reward = make_reward("remote", url=url, batch_size=2, concurrency=2)
scores = {}
for step in range(4):
    seed = 100 * rank + step
    batch = torch.rand(7, 3, 24, 24, generator=torch.Generator().manual_seed(seed))
    scores[seed] = reward(batch, [f"a photo {i}" for i in range(7)]).tolist()
reward.close()
json.dump(scores, open(out, "w"))
"""


@pytest.mark.timeout(300)  # two processes of their own, each importing torch
def test_training_ranks_in_processes_of_their_own_share_one_server(tmp_path: Path) -> None:
    """Two ranks, each a process with its own remote reward, score at once against one
    server: every batch's scores are the in-process ones."""
    local = make_reward("jpeg_incompressibility")
    environment = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'diffusion'}"}
    with serving_in_thread(make_reward("jpeg_incompressibility"), max_batch=4) as url:
        ranks = [
            subprocess.Popen(
                [sys.executable, "-c", RANK_SCRIPT, url, str(rank), str(tmp_path / f"{rank}")],
                env=environment,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in range(2)
        ]
        for process in ranks:
            assert process.wait(240) == 0, process.stderr.read()[-3000:]
    for rank in range(2):
        scores = json.loads((tmp_path / f"{rank}").read_text())
        assert len(scores) == 4
        for seed, got in scores.items():
            want = local(images(seed=int(seed)), PROMPTS)
            assert torch.equal(torch.tensor(got, dtype=want.dtype), want), seed


@pytest.mark.timeout(300)  # a process of its own: up to 90 s to start (it imports torch)
def test_serve_reward_on_the_command_line(tmp_path: Path) -> None:
    """The real command in a process of its own: options reach the reward, one log line per
    request, Ctrl-C stops it."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "mogradient_diffusion.cli", "serve-reward"]
    command += ["--reward", "jpeg_incompressibility", "--option", "quality=80"]
    command += ["--port", str(port), "--device", "cpu", "--max-batch", "2"]
    environment = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'diffusion'}"}
    log = tmp_path / "server.log"
    with log.open("w") as output:
        process = subprocess.Popen(command, stderr=output, stdout=output, env=environment)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90  # the process imports torch first
        while True:
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        remote = make_reward("remote", url=url, batch_size=5)
        try:
            scores = remote(images(), PROMPTS)
        finally:
            remote.close()
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
    expected = make_reward("jpeg_incompressibility", quality=80)(images(), PROMPTS)
    assert torch.equal(scores, expected)
    lines = log.read_text().splitlines()
    assert sum("reward jpeg_incompressibility: 5 images" in line for line in lines) == 1
    assert sum("reward jpeg_incompressibility: 2 images" in line for line in lines) == 1


def test_serve_reward_without_the_extra_or_with_a_bad_reward_says_so_in_one_line(
    monkeypatch, capsys
) -> None:
    assert cli.main(["serve-reward", "--reward", "jpeg_incompresibility"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("mogradient-diffusion serve-reward: unknown reward")
    assert "jpeg_incompressibility" in error and "\n" not in error
    assert cli.main(["serve-reward", "--reward", "jpeg_incompressibility", "--option", "q"]) == 2
    assert "expected KEY=VALUE" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    assert cli.main(["serve-reward", "--reward", "jpeg_incompressibility"]) == 2
    assert capsys.readouterr().err == (
        "mogradient-diffusion serve-reward: needs FastAPI and uvicorn (uvicorn is missing): "
        "pip install 'mogradient-diffusion[serve]'\n"
    )
