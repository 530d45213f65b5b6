"""Each wire format on its own (no network): what a request holds, how answers are read,
and which answers are refused."""

from __future__ import annotations

import base64
import io
import json
import math
import os
import pickle

import numpy as np
import pytest
from PIL import Image

from mogradient_diffusion.rewards.remote.flow_grpo import FlowGrpo
from mogradient_diffusion.rewards.remote.openai_judge import OpenAiJudge
from mogradient_diffusion.rewards.remote.ours import Ours
from mogradient_diffusion.rewards.remote.protocol import BadResponse
from mogradient_diffusion.rewards.remote.safe_pickle import UnsafePickleError
from mogradient_diffusion.rewards.remote.verl_omni import VerlOmni

SOURCE = "http://127.0.0.1:1"
IMAGES = np.random.default_rng(0).integers(0, 256, (2, 8, 8, 3), dtype=np.uint8)
PROMPTS = ["a cat", "a dog"]
METADATA = [{"tag": "single_object", "include": [{"class": "cat", "count": 1}]}, {"tag": "x"}]


def test_ours_sends_lossless_png_and_reads_null_as_not_applicable() -> None:
    body = json.loads(Ours().encode(IMAGES, PROMPTS, METADATA))
    assert body["version"] == 1 and body["prompts"] == PROMPTS and body["metadata"] == METADATA
    decoded = [np.asarray(Image.open(io.BytesIO(base64.b64decode(i)))) for i in body["images"]]
    assert np.array_equal(np.stack(decoded), IMAGES)
    answer = json.dumps({"version": 1, "scores": [0.5, None], "details": [{}, {}]}).encode()
    assert Ours().decode(answer, SOURCE) == [0.5, None]
    assert Ours().endpoint("http://h:1/") == "http://h:1/score"


@pytest.mark.parametrize(
    "answer",
    [b"<html>busy</html>", b'{"scores": [1]}', b'{"version": 1, "scores": ["1"]}', b"[1, 2]"],
)
def test_ours_refuses_answers_that_are_not_version_1_score_lists(answer: bytes) -> None:
    with pytest.raises(BadResponse):
        Ours().decode(answer, SOURCE)


def test_flow_grpo_sends_what_reward_server_reads_and_picks_the_score_list() -> None:
    body = pickle.loads(FlowGrpo().encode(IMAGES, PROMPTS, METADATA))
    assert set(body) == {"images", "prompts", "meta_datas", "only_strict"}
    assert all(isinstance(image, bytes) and image[:2] == b"\xff\xd8" for image in body["images"])
    assert body["meta_datas"] == METADATA and body["only_strict"] is True
    assert "meta_datas" not in pickle.loads(FlowGrpo().encode(IMAGES, PROMPTS, None))
    geneval = {"scores": [0.5, 1.0], "rewards": [0, 1], "group_rewards": {"colors": [-10.0, 1]}}
    assert FlowGrpo().decode(pickle.dumps(geneval), SOURCE) == [0.5, 1.0]
    deqa = {"outputs": np.array([0.25, 0.75], dtype=np.float32), "scores": [9, 9]}
    assert FlowGrpo().decode(pickle.dumps(deqa), SOURCE) == [0.25, 0.75]
    assert FlowGrpo(score_key="rewards").decode(pickle.dumps(geneval), SOURCE) == [0.0, 1.0]
    with pytest.raises(BadResponse, match=r"no 'strict' .*set score_key"):
        FlowGrpo(score_key="strict").decode(pickle.dumps(geneval), SOURCE)


@pytest.mark.parametrize(
    ("answer", "refused"),
    [
        (b"Traceback (most recent call last):\nKeyError: 'x'", BadResponse),
        (pickle.dumps([0.5]), BadResponse),
        (pickle.dumps({"outputs": "0.5"}), BadResponse),
        (pickle.dumps({"outputs": [0.5, "x"]}), BadResponse),
        (pickle.dumps({"outputs": [0.5], "hook": os.getcwd}), UnsafePickleError),
    ],
)
def test_flow_grpo_refuses_what_is_not_a_pickled_score_list(answer: bytes, refused) -> None:
    with pytest.raises(refused):
        FlowGrpo().decode(answer, SOURCE)


def test_the_error_detail_is_the_tracebacks_last_line_pickled_or_not() -> None:
    text = b"Traceback (most recent call last):\n  File x\nKeyError: 'meta_datas'\n"
    assert FlowGrpo().error_detail(text, SOURCE) == "KeyError: 'meta_datas'"
    pickled = pickle.dumps({"error": "Traceback ...\nValueError: bad image"})
    assert VerlOmni().error_detail(pickled, SOURCE) == "ValueError: bad image"
    assert Ours().error_detail(b'{"error": "reward \'x\' failed: boom"}', SOURCE).endswith("boom")


def test_verl_omni_sends_one_sample_and_fails_on_an_error_answer() -> None:
    body = pickle.loads(VerlOmni().encode(IMAGES[:1], PROMPTS[:1], None))
    assert body["prompts"] == ["a cat"] and body["metadata"] == {} and len(body["images"]) == 1
    assert VerlOmni().decode(pickle.dumps({"scores": [0.5]}), SOURCE) == [0.5]
    with pytest.raises(BadResponse, match="reported an error: ValueError: no text"):
        VerlOmni().decode(pickle.dumps({"error": "Traceback\nValueError: no text"}), SOURCE)
    with pytest.raises(BadResponse, match="no 'scores'"):
        VerlOmni().decode(pickle.dumps({"score": 0.5}), SOURCE)


def chat(content: str) -> bytes:
    return json.dumps(
        {"choices": [{"message": {"role": "assistant", "content": content}}]}
    ).encode()


def test_openai_judge_asks_with_a_png_data_url_and_maps_1_5_onto_0_1(monkeypatch) -> None:
    monkeypatch.setenv("JUDGE_KEY", "sk-test")
    judge = OpenAiJudge(model="judge", api_key_env="JUDGE_KEY", prompt_template="{x} [{prompt}]")
    body = json.loads(judge.encode(IMAGES[:1], ["a {cat}"], None))
    assert body["model"] == "judge" and body["temperature"] == 0
    image, text = body["messages"][0]["content"]
    assert image["image_url"]["url"].startswith("data:image/png;base64,")
    assert text == {"type": "text", "text": "{x} [a {cat}]"}
    assert judge.headers()["Authorization"] == "Bearer sk-test"
    assert judge.decode(chat("Fine detail.\nFinal Score: 4"), SOURCE) == [0.75]
    assert judge.decode(chat("Final Score: 1"), SOURCE) == [0.0]
    assert judge.decode(chat("Final Score: 5.0"), SOURCE) == [1.0]


@pytest.mark.parametrize("reply", ["I cannot judge this image.", "Final Score: 7", "Final Score:"])
def test_openai_judge_never_turns_a_reply_without_a_score_into_a_number(reply: str) -> None:
    with pytest.raises(BadResponse, match="no score in \\[1, 5\\]"):
        OpenAiJudge(model="judge").decode(chat(reply), SOURCE)


def test_openai_judge_pattern_and_range_are_options() -> None:
    judge = OpenAiJudge(model="m", score_pattern=r"(\d+)/10", score_range=[0, 10])
    assert judge.decode(chat("7/10"), SOURCE) == [0.7]
    for options, message in [
        ({"score_pattern": "Score"}, "needs a group"),
        ({"score_pattern": "("}, "not a regex"),
        ({"score_range": [5, 1]}, "low < high"),
        ({"prompt_template": "no placeholder"}, "{prompt}"),
        ({"api_key_env": "UNSET_JUDGE_KEY_VARIABLE"}, "not set"),
        ({"api_key_env": "sk-123"}, "name an environment variable"),
    ]:
        with pytest.raises(ValueError, match=message.replace("{", "\\{")):
            OpenAiJudge(model="m", **options)
    assert math.isclose(OpenAiJudge(model="m").value_range[1], 1.0)


HUGE = 10**400  # past a float's range: float() raises OverflowError


@pytest.mark.parametrize(
    ("scores", "refused"),
    [
        ([0.5, True], "True is not a number"),
        (np.array([True, False]), "True is not a number"),
        ([np.bool_(False)], "np.False_ is not a number"),
        ([0.5, HUGE], "an integer of 1329 bits is too large for a float"),
    ],
)
def test_bools_and_integers_past_a_float_are_refused_by_every_protocol(scores, refused) -> None:
    """Pickled ``True`` used to become the score 1.0 (our JSON refused it); a 400-digit
    integer raised OverflowError, not a bad answer."""
    for protocol, body in [
        (FlowGrpo(), pickle.dumps({"outputs": scores})),
        (VerlOmni(), pickle.dumps({"scores": scores})),
    ]:
        with pytest.raises(BadResponse, match=refused):
            protocol.decode(body, SOURCE)
    if isinstance(scores, list) and not isinstance(scores[-1], np.bool_):
        answer = json.dumps({"version": 1, "scores": scores}).encode()
        with pytest.raises(BadResponse, match=f"a score: {refused}"):
            Ours().decode(answer, SOURCE)
