"""Issue 40's "done means", end to end: a tiny MARBLE run whose three rewards are served on
127.0.0.1 (one by ``serve-reward``'s app on our protocol, one on Flow-GRPO's protocol, one
VLM judge on the OpenAI API) trains exactly as with the same rewards in process; a server
killed mid-run is one line (required) or NaN-marked samples with a logged count (optional),
never a 0.

Our protocol and the judge's send PNG of the images rounded to 8 bits, which is lossless
from there: these rewards read 8-bit pixels in process too (JPEG size, color rules), so the
served ones see the very pixels they see in process (a reward reading float pixels would
differ by the rounding). Flow-GRPO's protocol sends JPEG (PIL's default quality, as its
client does), which is lossy by design, so its reward's twin in process scores the same
JPEG round trip of each image: the comparison stays exact, and so does the training that
follows from the scores (a JPEG-sized difference in one score would reorder a group and
change every later epoch).
"""

from __future__ import annotations

import base64
import io
import json
import math
import pickle
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mogradient_diffusion.cli import main
from mogradient_diffusion.rewards import REWARDS, make_reward, register_reward
from mogradient_diffusion.rewards.base import to_uint8_images
from mogradient_diffusion.rewards.color import ColorMatch
from mogradient_diffusion.rewards.remote import RemoteReward
from mogradient_diffusion.rewards.remote.images import jpeg_bytes
from mogradient_diffusion.runs.metrics_log import read_metrics
from mogradient_diffusion.training.trainer import Trainer

from . import fakes
from .fakes import Answer, Received

pytest.importorskip("uvicorn", reason="the serve extra is not installed")

from mogradient_diffusion.rewards.remote.server import serving_in_thread

EPOCHS = 2  # the second epoch trains on what the first one's scores changed
# seconds per test: a tiny run takes about 10 s on 2 busy cores; these train up to twice
TRAINING = pytest.mark.timeout(300)
LABELS = ("jpeg", "color", "judge")
COARSE = {"min_share": 0.25, "graded": True}  # the tiny preset's color_match
FINE = {"min_share": 0.1, "graded": True}


def as_images(arrays: list[np.ndarray]) -> torch.Tensor:
    """[H, W, 3] uint8 arrays -> [B, 3, H, W] in [0, 1], as a server decodes them."""
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float() / 255


def jpeg_round_trip(images: torch.Tensor) -> torch.Tensor:
    """The images as a Flow-GRPO server reads them: the client's JPEG, decoded."""
    decoded = [
        np.asarray(Image.open(io.BytesIO(jpeg_bytes(array))).convert("RGB"))
        for array in to_uint8_images(images)
    ]
    return as_images(decoded)


class ColorAfterJpeg(ColorMatch):
    """``color_match`` on what Flow-GRPO's protocol delivers: the in-process twin."""

    name = "color_after_jpeg"

    def score(self, images, prompts, metadata):
        return super().score(jpeg_round_trip(images), prompts, metadata)


def flow_grpo_color(request: Received) -> Answer:
    """A Flow-GRPO reward server around the real ``color_match``: pickled JPEGs in,
    ``{"scores"}`` out."""
    data = pickle.loads(request.body)
    arrays = [np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB")) for jpeg in data["images"]]
    scores = make_reward("color_match", **COARSE)(as_images(arrays), data["prompts"])
    return 200, pickle.dumps({"scores": scores.tolist()})


def judge_reply(body: dict) -> str:
    """A VLM judge that answers with the real ``color_match`` (FINE) of the PNG it is sent,
    on a [0, 1] scale: its template is the bare prompt."""
    image_url, question = body["messages"][0]["content"]
    png = base64.b64decode(image_url["image_url"]["url"].split(",", 1)[1])
    array = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    score = make_reward("color_match", **FINE)(as_images([array]), [question["text"]])
    return f"The colors match.\nFinal Score: {float(score[0]):.20f}"


def entry(name: str, label: str, options: dict) -> str:
    return f"{{name: {name}, label: {label}, options: {json.dumps(options)}}}"


def train(run_dir: Path, model: Path, rewards: list[str], *overrides: str) -> int:
    """``train --preset tiny`` with ``rewards``: two sampled chunks an epoch."""
    run = [f"model.path={model}", f"run.directory={run_dir}", "run.quiet=true"]
    chunks = [f"train.epochs={EPOCHS}", "rollout.batch_size=4"]
    listed = f"rewards=[{', '.join(rewards)}]"
    return main(["train", "--preset", "tiny", *run, *chunks, listed, *overrides])


@pytest.fixture
def twin_registered() -> Iterator[None]:
    with REWARDS.restored():
        register_reward(ColorAfterJpeg)
        yield


@TRAINING
def test_served_rewards_train_exactly_as_in_process(
    tmp_path: Path, tiny_pipeline_dir: Path, twin_registered
) -> None:
    in_process = [
        entry("jpeg_incompressibility", "jpeg", {}),
        entry("color_after_jpeg", "color", COARSE),
        entry("color_match", "judge", FINE),
    ]
    assert train(tmp_path / "local", tiny_pipeline_dir, in_process) == 0
    with ExitStack() as servers:
        ours = servers.enter_context(
            serving_in_thread(make_reward("jpeg_incompressibility"), max_batch=4)
        )
        flow_grpo = servers.enter_context(fakes.serving(flow_grpo_color))
        judge = servers.enter_context(fakes.serving(fakes.judge(judge_reply)))
        judge_options = {"protocol": "openai_judge", "model": "judge"}
        judge_options |= {"prompt_template": "{prompt}", "score_range": [0, 1]}
        served = [
            entry("remote", "jpeg", {"url": ours}),
            entry("remote", "color", {"url": flow_grpo.url, "protocol": "flow_grpo"}),
            entry("remote", "judge", {"url": f"{judge.url}/v1", **judge_options}),
        ]
        overlapped = "rollout.overlap_rewards=true"
        assert train(tmp_path / "remote", tiny_pipeline_dir, served, overlapped) == 0
    assert len(flow_grpo.received) == 2 * EPOCHS  # one request per sampled chunk
    assert len(judge.received) == 8 * EPOCHS  # one per image
    local, remote = read_metrics(tmp_path / "local"), read_metrics(tmp_path / "remote")
    assert len(local) == len(remote) == EPOCHS
    for epoch, (expected, got) in enumerate(zip(local, remote, strict=True)):
        for label in LABELS:
            key = f"reward/{label}/mean"
            assert math.isfinite(got[key]), (epoch, key)
            assert math.isclose(got[key], expected[key], rel_tol=1e-6), (epoch, key)
            assert f"reward/{label}/failed" not in got  # required rewards stop instead
    steps = [step["weights"] for record in remote for step in record["optimizer_steps"]]
    assert steps == [step["weights"] for record in local for step in record["optimizer_steps"]]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def server_killed_after_the_first_epoch(monkeypatch) -> Iterator[str]:
    """A Flow-GRPO-protocol server in a process of its own, killed as the second epoch
    starts; yields its URL."""
    port = free_port()
    script = [sys.executable, str(Path(fakes.__file__)), "deqa", str(port)]
    process = subprocess.Popen(script, stdout=subprocess.PIPE, text=True)
    original = Trainer.train_epoch

    def train_epoch(trainer: Trainer):
        if trainer.epoch == 1:
            process.kill()
            process.wait(10)
        return original(trainer)

    monkeypatch.setattr(Trainer, "train_epoch", train_epoch)
    try:
        assert process.stdout.readline().startswith("serving")
        yield f"http://127.0.0.1:{port}"
    finally:
        process.kill()
        process.wait(10)


@TRAINING
def test_an_optional_server_killed_mid_run_gives_nan_and_a_logged_count(
    tmp_path: Path, tiny_pipeline_dir: Path, server_killed_after_the_first_epoch: str, capsys
) -> None:
    options = {"url": server_killed_after_the_first_epoch, "protocol": "flow_grpo"}
    options |= {"required": False, "retries": 0}
    rewards = [entry("color_match", "color", COARSE), entry("remote", "quality", options)]
    overrides = ("train.epochs=2", "rollout.overlap_rewards=true")
    assert train(tmp_path, tiny_pipeline_dir, rewards, *overrides) == 0
    first, second = read_metrics(tmp_path)
    assert first["reward/quality/failed"] == 0 and math.isfinite(first["reward/quality/mean"])
    assert second["reward/quality/failed"] == 8  # every sample, marked NaN: never a 0
    assert second["reward/quality/mean"] is None  # NaN: metrics.jsonl writes null
    assert second["rewards_without_signal"] == ["quality"]
    assert math.isfinite(second["reward/color/mean"])
    warnings = [line for line in capsys.readouterr().err.splitlines() if "could not score" in line]
    epoch_lines = [line for line in warnings if line.startswith("mogradient-diffusion: warning")]
    assert epoch_lines == [
        "mogradient-diffusion: warning: epoch 1: reward 'quality' could not score 8 of 8 "
        "samples (required: false): they count as not applicable (NaN), so the other rewards "
        "alone decided their advantages"
    ]


@TRAINING
def test_a_required_server_killed_mid_run_stops_it_in_one_line(
    tmp_path: Path, tiny_pipeline_dir: Path, server_killed_after_the_first_epoch: str, capsys
) -> None:
    url = server_killed_after_the_first_epoch
    rewards = [
        entry("color_match", "color", COARSE),
        entry("remote", "quality", {"url": url, "protocol": "flow_grpo", "retries": 0}),
    ]
    overrides = ("train.epochs=2", "rollout.overlap_rewards=true")
    assert train(tmp_path, tiny_pipeline_dir, rewards, *overrides) == 1
    error = capsys.readouterr().err
    assert "Traceback" not in error
    line = error.strip().splitlines()[-1]
    assert line.startswith(
        f"mogradient-diffusion: training stopped: reward 'quality': {url} could not score 4 "
        "image(s): ConnectError: "
    )
    assert line.endswith(
        f"(after 1 attempt(s)); the last checkpoint, {tmp_path}/checkpoints/step_00000001, "
        "is intact: the same command resumes from it"
    )


@TRAINING
def test_sdpo_counts_failed_intermediate_states_out_of_what_was_asked(
    tmp_path: Path, tiny_pipeline_dir: Path, capsys, monkeypatch
) -> None:
    """SDPO also scores each pair's first and anchor states: their failures are counted
    too, so the warning's total must hold them ("24 of 8 samples" before). The run closes
    its remote reward when it ends."""
    closed: list[str] = []
    close = RemoteReward.close
    monkeypatch.setattr(RemoteReward, "close", lambda self: (closed.append(self.name), close(self)))
    options = {"url": f"http://127.0.0.1:{free_port()}", "protocol": "flow_grpo"}
    options |= {"required": False, "retries": 0}  # nothing listens: every request fails
    rewards = [entry("color_match", "color", COARSE), entry("remote", "quality", options)]
    sdpo = ["objective.name=sdpo", "rollout.sampler=sde", "train.old_schedule=copy"]
    sdpo += ["strategy.name=weighted_sum", "strategy.period=null"]  # no solve step: quicker
    overrides = ("train.epochs=1", "rollout.overlap_rewards=true", *sdpo)
    assert train(tmp_path, tiny_pipeline_dir, rewards, *overrides) == 0
    (record,) = read_metrics(tmp_path)
    assert record["reward/quality/failed"] == 24  # 8 samples, their first and anchor states
    warnings = [line for line in capsys.readouterr().err.splitlines() if "could not" in line]
    assert warnings == [
        "mogradient-diffusion: warning: epoch 0: reward 'quality' could not score 24 of 24 "
        "images (8 samples, 16 intermediate states) (required: false): they count as not "
        "applicable (NaN), so the other rewards alone decided their advantages"
    ]
    assert closed == ["quality"]
