"""Prompt files (plain text, GenEval JSONL) and the stratified, resumable sampler."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from mogradient_diffusion.prompts.sources import (
    PromptSource,
    StratifiedPromptSampler,
    find_prompt_file,
    load_geneval_metadata,
    load_prompt_file,
    load_prompt_sources,
    load_text_prompts,
)
from mogradient_diffusion.rewards import quoted_text

SHARED_PROMPTS = Path(__file__).resolve().parents[3] / "shared" / "prompts"

GENEVAL_LINES = [
    {"tag": "single_object", "include": [{"class": "cat", "count": 1}], "prompt": "a cat"},
    {
        "tag": "counting",
        "include": [{"class": "cup", "count": 2}],
        "exclude": [{"class": "cup", "count": 3}],
        "prompt": "a photo of two cups",
    },
    {
        "tag": "color_attr",
        "include": [
            {"class": "car", "count": 1, "color": "red"},
            {"class": "dog", "count": 1, "color": "blue"},
        ],
        "prompt": "a photo of a red car and a blue dog",
    },
]


def write_geneval(path: Path, items=GENEVAL_LINES) -> Path:
    path.write_text("\n".join(json.dumps(item) for item in items) + "\n", encoding="utf-8")
    return path


def test_text_file(tmp_path):
    path = tmp_path / "ocr_train.txt"
    path.write_text('  A sign "OPEN"  \n\n\t\nA mug "Hi"\n  \nlast line, no newline', "utf-8")
    source = load_text_prompts(path)
    assert source.name == "ocr_train"
    assert source.prompts == ('A sign "OPEN"', 'A mug "Hi"', "last line, no newline")
    assert source.metadata == ({}, {}, {})
    assert load_prompt_file(path, "ocr").name == "ocr"


def test_geneval_file_keeps_metadata(tmp_path):
    source = load_prompt_file(write_geneval(tmp_path / "geneval.jsonl"))
    assert source.prompts == ("a cat", "a photo of two cups", "a photo of a red car and a blue dog")
    assert source.metadata[1]["exclude"] == [{"class": "cup", "count": 3}]
    assert source.metadata[2]["include"][0]["color"] == "red"
    named = load_geneval_metadata(tmp_path / "geneval.jsonl", name="geneval_train")
    assert named.name == "geneval_train" and named.metadata == source.metadata


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("", "no prompts"),
        ("\n  \n\t\n", "no prompts"),
        ('{"prompt": "ok"}\n\n{"prompt": broken}\n', r"bad\.jsonl:3: invalid JSON"),
        ('{"prompt": "ok"}\n["a list"]\n', r"bad\.jsonl:2: expected a JSON object"),
        ('{"tag": "no prompt"}\n', r"bad\.jsonl:1: expected a JSON object with a string"),
        ('{"prompt": "  "}\n', r"bad\.jsonl:1: empty 'prompt'"),
    ],
)
def test_geneval_errors_name_file_and_line(tmp_path, content, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=match):
        load_prompt_file(path)


def test_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"missing\.txt"):
        load_text_prompts(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("\n\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"empty\.txt: no prompts"):
        load_text_prompts(tmp_path / "empty.txt")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.txt: not UTF-8"):
        load_text_prompts(tmp_path / "latin1.txt")


def test_directory_layouts(tmp_path):
    (tmp_path / "pickscore").mkdir()
    (tmp_path / "pickscore" / "train.txt").write_text("a castle\na dragon\n", "utf-8")
    (tmp_path / "geneval").mkdir()
    write_geneval(tmp_path / "geneval" / "train_metadata.jsonl")
    (tmp_path / "ocr_test.txt").write_text('a sign "A"\n', "utf-8")
    write_geneval(tmp_path / "geneval_test_metadata.jsonl", GENEVAL_LINES[:1])

    train = load_prompt_sources(tmp_path, ["pickscore", "geneval"])
    assert [(s.name, len(s)) for s in train] == [("pickscore", 2), ("geneval", 3)]
    test = load_prompt_sources(tmp_path, ["ocr", "geneval"], split="test")
    assert [(s.name, len(s)) for s in test] == [("ocr", 1), ("geneval", 1)]
    assert test[1].metadata[0]["tag"] == "single_object"
    with pytest.raises(FileNotFoundError, match=r"'ocr'.*tried .*ocr/train\.txt"):
        find_prompt_file(tmp_path, "ocr", "train")


def test_prompt_source_validation():
    with pytest.raises(ValueError, match="no prompts"):
        PromptSource("x", ())
    with pytest.raises(ValueError, match="2 prompts but 1 metadata"):
        PromptSource("x", ("a", "b"), ({},))


def sources() -> list[PromptSource]:
    return [
        PromptSource("pickscore", tuple(f"pick {i}" for i in range(50))),
        PromptSource("ocr", tuple(f'ocr "{i}"' for i in range(7))),
        PromptSource(
            "geneval", tuple(f"gen {i}" for i in range(20)), tuple({"i": i} for i in range(20))
        ),
    ]


def test_stratified_proportions():
    sampler = StratifiedPromptSampler(sources(), weights=[2, 1, 1], seed=0)
    for _ in range(10):
        assert Counter(s for _, s, _ in sampler.sample(8)) == {
            "pickscore": 4,
            "ocr": 2,
            "geneval": 2,
        }

    sampler = StratifiedPromptSampler(sources(), seed=0)  # equal weights, 4 does not divide by 3
    totals = Counter()
    for _ in range(30):
        counts = Counter(s for _, s, _ in sampler.sample(4))
        assert sum(counts.values()) == 4 and all(1 <= c <= 2 for c in counts.values())
        totals += counts
    assert totals == {"pickscore": 40, "ocr": 40, "geneval": 40}

    only = StratifiedPromptSampler(sources(), weights=[0, 1, 0], seed=0)
    assert {s for _, s, _ in only.sample(5)} == {"ocr"}


@pytest.mark.parametrize("weights", [None, [2, 1, 1], [0.1, 0.3, 0.6]])
def test_every_batch_has_exactly_the_asked_size_and_its_share(weights):
    """Small batches over several sources once returned negative seats (more prompts than
    asked): carried credit went below -1 and its floor became a negative count."""
    sampler = StratifiedPromptSampler(sources(), weights=weights, seed=0)
    shares = np.ones(3) / 3 if weights is None else np.array(weights) / np.sum(weights)
    totals = np.zeros(3)
    for size in [1, 1, 2, 1, 3, 1, 1, 5, 2, 1, 1, 4, 1, 1]:
        batch = sampler.sample(size)
        assert len(batch) == size
        names = [prompt.source for prompt in batch]
        totals += [names.count(source.name) for source in sampler.sources]
        assert np.all(np.abs(totals - totals.sum() * shares) < 1 + 1e-9)


def test_without_replacement_within_each_pass():
    sampler = StratifiedPromptSampler(sources(), weights=[0, 1, 0], seed=3)
    first = [p for p, _, _ in sampler.sample(7)]
    second = [p for p, _, _ in sampler.sample(7)]
    assert sorted(first) == sorted(second) == sorted(sources()[1].prompts)
    assert first != second  # a fresh permutation per pass
    drawn = Counter(p for p, _, _ in sampler.sample(10))  # a full pass and 3 of the next
    assert len(drawn) == 7 and sorted(drawn.values()) == [1] * 4 + [2] * 3


def test_metadata_is_returned_as_a_copy():
    source = sources()[2]
    sampler = StratifiedPromptSampler([source], seed=0)
    prompt, name, metadata = sampler.sample(1)[0]
    assert name == "geneval" and metadata == {"i": int(prompt.split()[1])}
    metadata["i"] = "changed"
    assert all(m["i"] != "changed" for m in source.metadata)


def test_determinism_and_exact_resume():
    def run(seed, batches):
        sampler = StratifiedPromptSampler(sources(), weights=[3, 1, 2], seed=seed)
        return [sampler.sample(5) for _ in range(batches)]

    assert run(1, 6) == run(1, 6)
    assert run(1, 6) != run(2, 6)

    sampler = StratifiedPromptSampler(sources(), weights=[3, 1, 2], seed=1)
    for _ in range(4):
        sampler.sample(5)
    state = json.loads(json.dumps(sampler.state_dict()))  # survives a JSON round trip
    expected = [sampler.sample(5) for _ in range(8)]
    resumed = StratifiedPromptSampler(sources(), weights=[3, 1, 2], seed=1)
    resumed.load_state_dict(state)
    assert [resumed.sample(5) for _ in range(8)] == expected
    assert run(1, 12)[4:] == expected


def test_sampler_errors():
    with pytest.raises(ValueError, match="2 weights for 3 sources"):
        StratifiedPromptSampler(sources(), weights=[1, 1])
    with pytest.raises(ValueError, match="weights must be"):
        StratifiedPromptSampler(sources(), weights=[1, -1, 1])
    with pytest.raises(ValueError, match="weights must be"):
        StratifiedPromptSampler(sources(), weights=[0, 0, 0])
    with pytest.raises(ValueError, match="duplicate source names"):
        StratifiedPromptSampler([sources()[0], sources()[0]])
    with pytest.raises(ValueError, match="num_prompts"):
        StratifiedPromptSampler(sources()).sample(0)
    state = StratifiedPromptSampler(sources(), seed=0).state_dict()
    with pytest.raises(ValueError, match="over sources"):
        StratifiedPromptSampler(sources()[:2], seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        StratifiedPromptSampler(sources(), seed=1).load_state_dict(state)


@pytest.mark.skipif(not SHARED_PROMPTS.is_dir(), reason="reference prompt files not present")
def test_reference_prompt_files():
    loaded = load_prompt_sources(
        SHARED_PROMPTS, ["pickscore", "ocr", "drawbench", "geneval"], "test"
    )
    # Three of the files end without a newline, so `wc -l` reports one line fewer.
    assert [len(s) for s in loaded] == [2048, 1018, 1000, 2212]
    assert all(quoted_text(p) for p in loaded[1].prompts)
    tags = Counter(m["tag"] for m in loaded[3].metadata)
    assert set(tags) == {
        "single_object",
        "two_object",
        "counting",
        "colors",
        "position",
        "color_attr",
    }
    sampler = StratifiedPromptSampler([loaded[0], loaded[1], loaded[3]], seed=0)
    assert Counter(s for _, s, _ in sampler.sample(24)) == {"pickscore": 8, "ocr": 8, "geneval": 8}
