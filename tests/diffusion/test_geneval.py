"""GenEval: the scoring rules on hand-made detections, and the rewards on tiny random models.

The rule tests pin GenEval's strict accuracy and Flow-GRPO's partial score to values
computed by hand. The model tests build a tiny Mask2Former (Swin backbone) and a tiny
CLIP offline, save them in the layout the real checkpoints have, and load them through
the rewards' ``path`` / ``clip_path`` options.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from mogradient_diffusion.rewards.geneval_rules import (
    COLORS,
    CROP_BACKGROUND,
    GENEVAL_CLASSES,
    Detection,
    box_iou,
    confidence_threshold,
    geneval_class_name,
    is_geneval_metadata,
    mask_to_box,
    object_crop,
    partial_score,
    partial_terms,
    relations,
    select_objects,
    strict_correct,
    validate_metadata,
)


def det(label: str, score: float = 0.95, box=(0, 0, 10, 10), color: str | None = None):
    return Detection(label, score, tuple(float(v) for v in box), color=color)


def both(objects, meta) -> tuple[bool, float]:
    return strict_correct(objects, meta), partial_score(objects, meta)


# --- selection -------------------------------------------------------------------------


def test_select_objects_sorts_thresholds_strictly_and_groups_by_class():
    dets = [det("dog", s) for s in (0.5, 0.95, 0.3, 0.2, 0.31)] + [det("cat", 0.1)]
    objects = select_objects(dets, threshold=0.3)
    assert [d.score for d in objects["dog"]] == [0.95, 0.5, 0.31]  # 0.3 is not > 0.3
    assert "cat" not in objects
    counting = {"tag": "counting", "include": [{"class": "dog", "count": 1}]}
    assert confidence_threshold(counting) == 0.9
    assert confidence_threshold({"tag": "position", "include": []}) == 0.3
    assert [d.score for d in select_objects(dets, confidence_threshold(counting))["dog"]] == [0.95]


def test_select_objects_caps_at_max_objects_keeping_the_most_confident():
    dets = [det("dog", 0.4 + 0.01 * i) for i in range(20)]
    kept = select_objects(dets, threshold=0.3, max_objects=16)["dog"]
    assert len(kept) == 16
    assert kept[0].score == pytest.approx(0.59) and kept[-1].score == pytest.approx(0.44)


def test_box_iou_and_greedy_nms():
    a, b, far = (0, 0, 10, 10), (1, 0, 11, 10), (50, 50, 60, 60)
    assert box_iou(a, b) == pytest.approx(90 / 110)
    assert box_iou(a, far) == 0.0
    assert box_iou(a, a) == 1.0
    dets = [det("dog", 0.9, a), det("dog", 0.8, b), det("dog", 0.7, far)]
    assert len(select_objects(dets, nms_threshold=1.0)["dog"]) == 3  # GenEval: NMS off
    kept = select_objects(dets, nms_threshold=0.5)["dog"]
    assert [d.score for d in kept] == [0.9, 0.7]
    assert len(select_objects(dets, nms_threshold=0.9)["dog"]) == 3  # 0.818 < 0.9


# --- relations -------------------------------------------------------------------------


def test_each_relation_with_y_growing_downward():
    centre = (20, 20, 30, 30)
    assert relations((0, 20, 10, 30), centre) == {"left of"}
    assert relations((40, 20, 50, 30), centre) == {"right of"}
    assert relations((20, 0, 30, 10), centre) == {"above"}
    assert relations((20, 40, 30, 50), centre) == {"below"}
    # Diagonal: offset (-20, -20), shrunk by 2 per axis -> (-18, -18) / 28.28 = -0.64 each.
    assert relations((0, 0, 10, 10), centre) == {"left of", "above"}
    # Offset (-20, -40) -> (-18, -38) / 44.7 = (-0.40, -0.85): above only.
    assert relations((0, -20, 10, -10), centre) == {"above"}


def test_relation_margin_and_no_relation():
    a = (0, 0, 10, 10)
    # Offset -12, margin 0.1 * (10 + 10) = 2 -> -10 / 12 = -0.83.
    assert relations(a, (12, 0, 22, 10)) == {"left of"}
    assert relations(a, (12, 0, 22, 10), margin=0.6) == frozenset()  # 12 - 12 = 0
    assert relations(a, (1, 0, 11, 10)) == frozenset()  # offset 1 < margin 2
    assert relations(a, a) == frozenset()


# --- strict versus partial -------------------------------------------------------------


def dogs(n: int, colors: list[str] | None = None):
    colors = colors or [None] * n
    return {"dog": [det("dog", 0.99 - 0.01 * i, color=c) for i, c in enumerate(colors)]}


@pytest.mark.parametrize(
    ("found", "strict", "partial"),
    [(2, True, 1.0), (3, True, 0.5), (1, False, 0.5), (0, False, 0.0), (4, True, 0.0)],
)
def test_counting_strict_is_at_least_partial_is_graded(found, strict, partial):
    meta = {"tag": "counting", "include": [{"class": "dog", "count": 2}]}
    assert both(dogs(found) if found else {}, meta) == (strict, partial)


def test_partial_count_term_goes_negative_and_the_score_is_clamped_at_zero():
    meta = {"include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1}]}
    objects = {**dogs(4), "cat": [det("cat")]}
    assert partial_terms(objects, meta) == [-2.0, 1.0]
    assert partial_score(objects, meta) == 0.0
    assert strict_correct(objects, meta)


def test_exclude_fails_strict_only():
    meta = {
        "tag": "counting",
        "include": [{"class": "dog", "count": 2}],
        "exclude": [{"class": "dog", "count": 3}],
    }
    assert both(dogs(2), meta) == (True, 1.0)
    assert both(dogs(3), meta) == (False, 0.5)


def test_color_requirement():
    meta = {"tag": "colors", "include": [{"class": "dog", "count": 2, "color": "red"}]}
    assert both(dogs(2, ["red", "red"]), meta) == (True, 1.0)
    assert partial_terms(dogs(2, ["red", "blue"]), meta) == [1.0, 0.5]
    assert both(dogs(2, ["red", "blue"]), meta) == (False, 0.75)
    # Strict judges the two most confident dogs; partial needs the exact count first.
    assert partial_terms(dogs(3, ["red", "red", "blue"]), meta) == [0.5, 0.0]
    assert both(dogs(3, ["red", "red", "blue"]), meta) == (True, 0.25)
    assert both(dogs(3, ["red", "blue", "red"]), meta) == (False, 0.25)
    with pytest.raises(ValueError, match="no color"):
        strict_correct(dogs(2), meta)


POSITION = {
    "tag": "position",
    "include": [
        {"class": "laptop", "count": 1},
        {"class": "cow", "count": 1, "position": ["right of", 0]},
    ],
}


def test_position_satisfied_violated_and_target_missing():
    laptop, cow_right, cow_left = (0, 0, 10, 10), (30, 0, 40, 10), (-30, 0, -20, 10)
    ok = {"laptop": [det("laptop", box=laptop)], "cow": [det("cow", box=cow_right)]}
    assert partial_terms(ok, POSITION) == [1.0, 1.0, 1.0]
    assert both(ok, POSITION) == (True, 1.0)
    wrong = {"laptop": [det("laptop", box=laptop)], "cow": [det("cow", box=cow_left)]}
    # One 0.0 for the violation (the reference server's extra 1.0 is not reproduced).
    assert partial_terms(wrong, POSITION) == [1.0, 1.0, 0.0]
    assert both(wrong, POSITION) == (False, pytest.approx(2 / 3))
    missing = {"cow": [det("cow", box=cow_right)]}
    assert partial_terms(missing, POSITION) == [0.0, 1.0, 0.0]
    assert both(missing, POSITION) == (False, pytest.approx(1 / 3))


def test_position_targets_strict_top_count_but_partial_needs_exact_count():
    # The second laptop (less confident) lies right of the cow; strict only looks at the first.
    laptops = [det("laptop", 0.9, (0, 0, 10, 10)), det("laptop", 0.5, (60, 0, 70, 10))]
    objects = {"laptop": laptops, "cow": [det("cow", box=(30, 0, 40, 10))]}
    assert strict_correct(objects, POSITION)
    # Partial: laptop count term 1 - |1 - 2| / 1 = 0, its group unmatched, so position 0.
    assert partial_terms(objects, POSITION) == [0.0, 1.0, 0.0]
    swapped = [det("laptop", 0.9, (60, 0, 70, 10)), det("laptop", 0.5, (0, 0, 10, 10))]
    assert not strict_correct({**objects, "laptop": swapped}, POSITION)


def test_every_found_object_against_every_target():
    meta = {
        "include": [
            {"class": "cat", "count": 2},
            {"class": "dog", "count": 1, "position": ["below", 0]},
        ]
    }
    cats = [det("cat", 0.9, (0, 0, 10, 10)), det("cat", 0.8, (40, 0, 50, 10))]
    assert both({"cat": cats, "dog": [det("dog", box=(20, 30, 30, 40))]}, meta) == (True, 1.0)
    # Beside the second cat rather than below it: fails against that target.
    assert both({"cat": cats, "dog": [det("dog", box=(60, 5, 70, 15))]}, meta) == (
        False,
        pytest.approx(2 / 3),
    )


def test_empty_include_and_applicability():
    assert both({}, {"include": []}) == (True, 0.0)
    assert not is_geneval_metadata(None)
    assert not is_geneval_metadata({})
    assert not is_geneval_metadata({"prompt": "a dog"})
    assert is_geneval_metadata({"include": []})


@pytest.mark.parametrize(
    "meta",
    [
        {"include": "dog"},
        {"include": [{"class": "dog", "count": 0}]},
        {"include": [{"class": "dog", "count": 1, "color": "teal"}]},
        {"include": [{"class": "dog", "count": 1, "position": ["left of", 0]}]},
        {"include": [{"class": "a", "count": 1}, {"class": "b", "position": ["near", 0]}]},
        {"include": [], "exclude": [{"class": "dog"}]},
    ],
)
def test_malformed_metadata_is_an_error(meta):
    with pytest.raises(ValueError, match="GenEval metadata"):
        validate_metadata(meta)


def test_sample_metadata_format_validates():
    validate_metadata(POSITION)
    validate_metadata(
        {
            "tag": "color_attr",
            "include": [
                {"class": "handbag", "count": 1, "color": "pink"},
                {"class": "scissors", "count": 1, "color": "black"},
            ],
            "prompt": "a photo of a pink handbag and a black scissors",
        }
    )


def test_class_names_masks_and_crops():
    assert geneval_class_name("keyboard") == "computer keyboard"
    assert geneval_class_name("Traffic_Light") == "traffic light"
    assert geneval_class_name("diningtable") == "dining table"
    assert geneval_class_name("dog") == "dog"
    coco_short = ("mouse", "remote", "keyboard", "motorbike", "sofa", "tvmonitor", "hair dryer")
    assert all(geneval_class_name(name) in GENEVAL_CLASSES for name in coco_short)
    assert len(set(GENEVAL_CLASSES)) == 80
    mask = np.zeros((8, 10), dtype=bool)
    mask[2:5, 3:7] = True
    assert mask_to_box(mask) == (3.0, 2.0, 7.0, 5.0)
    image = np.full((8, 10, 3), 200, dtype=np.uint8)
    mask[4, 3] = False
    crop = object_crop(image, Detection("dog", 0.9, mask_to_box(mask), mask=mask))
    assert crop.shape == (3, 4, 3)
    assert tuple(crop[2, 0]) == CROP_BACKGROUND and tuple(crop[0, 0]) == (200, 200, 200)


# --- the rewards on tiny models ----------------------------------------------------------

transformers = pytest.importorskip("transformers")

from mogradient_diffusion.rewards.geneval import GenEval, GenEvalStrict, _unpadded  # noqa: E402
from mogradient_diffusion.rewards.local_weights import MissingWeightsError  # noqa: E402
from mogradient_diffusion.rewards.registry import make_reward  # noqa: E402

from .reward_models import save_tiny_clip, save_tiny_mask2former  # noqa: E402

LABELS = ("person", "dog", "cat", "traffic light", "keyboard")


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> dict[str, Path]:
    """Directories of a tiny random Mask2Former and CLIP, saved like the real checkpoints."""
    detector_dir = save_tiny_mask2former(tmp_path_factory.mktemp("mask2former"), LABELS)
    clip_dir = save_tiny_clip(tmp_path_factory.mktemp("clip"))
    return {"path": detector_dir, "clip_path": clip_dir}


# Keep every query the random detector proposes, so the whole pipeline has work to do.
LOOSE = {"threshold": 0.0, "counting_threshold": 0.0, "detector_size": 64}

METAS = [
    {
        "tag": "counting",
        "include": [{"class": "dog", "count": 2}],
        "exclude": [{"class": "dog", "count": 3}],
    },
    None,
    {
        "tag": "color_attr",
        "include": [
            {"class": "computer keyboard", "count": 1, "color": "red"},
            {"class": "cat", "count": 1, "color": "blue"},
        ],
    },
    {
        "tag": "position",
        "include": [
            {"class": "person", "count": 1},
            {"class": "dog", "count": 1, "position": ["left of", 0]},
        ],
    },
    {"prompt": "no geneval fields"},
]


def images(n: int, height: int = 48, width: int = 48, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, 3, height, width, generator=torch.Generator().manual_seed(seed))


def test_real_tiny_models_end_to_end(weights):
    reward = GenEval(**weights, **LOOSE)
    batch = images(len(METAS))
    scores = reward(batch, ["p"] * len(METAS), METAS)
    assert scores.shape == (len(METAS),) and scores.dtype == torch.float32
    assert [math.isnan(s) for s in scores.tolist()] == [False, True, False, False, True]
    present = scores[~scores.isnan()]
    assert ((present >= 0) & (present <= 1)).all()

    outcomes = reward.evaluate(batch, METAS)
    assert outcomes[1] is None and outcomes[4] is None
    color_objects = [
        d for label in ("computer keyboard", "cat") for d in outcomes[2].objects.get(label, [])
    ]
    assert color_objects, "the loose thresholds should keep some color-clause objects"
    assert all(d.color in COLORS for d in color_objects)
    for dets in outcomes[0].objects.values():
        assert all(d.mask.shape == (48, 48) and d.mask.any() for d in dets)
        assert [d.score for d in dets] == sorted((d.score for d in dets), reverse=True)
    assert scores[0].item() == pytest.approx(outcomes[0].score)

    strict = GenEvalStrict(**weights, **LOOSE)(batch, ["p"] * len(METAS), METAS)
    assert set(strict[~strict.isnan()].tolist()) <= {0.0, 1.0}
    assert strict.isnan().tolist() == scores.isnan().tolist()


def test_color_classifier_is_the_renormalised_template_mean(weights):
    reward = GenEval(**weights, **LOOSE)
    assert reward.to("cpu") is reward
    classifier = reward._color_classifier("cat")
    assert classifier.shape == (len(COLORS), 12)  # the tiny CLIP projects to 12
    torch.testing.assert_close(classifier.norm(dim=-1), torch.ones(len(COLORS)))
    texts = [
        "a photo of a green cat",
        "a photo of a green-colored cat",
        "a photo of a green object",
    ]
    mean = reward._clip_model().text_features(texts).mean(0)
    torch.testing.assert_close(classifier[COLORS.index("green")], mean / mean.norm())


def test_non_square_images_keep_full_size_masks(weights):
    reward = GenEval(**weights, **LOOSE)
    outcome = reward.evaluate(images(1, 40, 72), METAS[:1])[0]
    assert all(d.mask.shape == (40, 72) for dets in outcome.objects.values() for d in dets)


def test_padding_is_cut_from_the_mask_logits():
    # A 64 x 115 image padded to 64 x 128; mask logits at a quarter of the padded size.
    pixel_mask = torch.zeros(2, 64, 128, dtype=torch.long)
    pixel_mask[:, :, :115] = 1
    logits = torch.randn(2, 5, 16, 32)
    cut = _unpadded(logits, pixel_mask, torch.Size((64, 128)))
    assert cut.shape == (2, 5, 16, 29)  # ceil(115 / 4)
    torch.testing.assert_close(cut, logits[..., :29])
    full = torch.ones(2, 64, 128, dtype=torch.long)
    assert _unpadded(logits, full, torch.Size((64, 128))).shape == logits.shape


def test_no_metadata_is_all_nan_without_running_the_detector(weights, monkeypatch):
    reward = GenEval(**weights, **LOOSE)

    def detector_must_not_run(*args, **kwargs):
        raise AssertionError("detector ran on samples without GenEval metadata")

    monkeypatch.setattr(reward, "detect", detector_must_not_run)
    assert reward(images(3), ["a", "b", "c"]).isnan().all()
    assert reward(images(2), ["a", "b"], [None, {}]).isnan().all()


def test_batch_size_chunks_and_matches_the_whole_batch(weights, monkeypatch):
    whole = GenEval(**weights, **LOOSE)
    chunked = GenEval(**weights, **LOOSE, batch_size=2)
    seen = []
    real_detect = chunked.detect
    monkeypatch.setattr(
        chunked, "detect", lambda arrays, *a: seen.append(len(arrays)) or real_detect(arrays, *a)
    )
    metas = [METAS[0], METAS[3], METAS[0], METAS[3], METAS[0]]
    batch = images(5, seed=1)
    expected = whole(batch, ["p"] * 5, metas)
    torch.testing.assert_close(chunked(batch, ["p"] * 5, metas), expected)
    assert seen == [2, 2, 1]


def fake_detections(boxes_by_label: dict[str, list[tuple]]):
    """Test double for ``GenEvalBase.detect``: fixed detections with full-image masks."""

    def detect(arrays, min_score=0.0):
        height, width = arrays.shape[1:3]
        out = []
        for _ in arrays:
            dets = []
            for label, boxes in boxes_by_label.items():
                for k, box in enumerate(boxes):
                    mask = np.zeros((height, width), dtype=bool)
                    mask[box[1] : box[3], box[0] : box[2]] = True
                    dets.append(Detection(label, 0.95 - 0.01 * k, mask_to_box(mask), mask))
            out.append(dets)
        return out

    return detect


def test_scores_follow_the_rules_with_fixed_detections(weights, monkeypatch):
    graded = make_reward("geneval", **weights, detector_size=64)
    strict = make_reward("geneval_strict", **weights, detector_size=64)
    assert isinstance(graded, GenEval) and isinstance(strict, GenEvalStrict)
    scene = {"person": [(30, 10, 40, 20)], "dog": [(2, 10, 10, 20), (12, 30, 20, 40), (2, 2, 6, 6)]}
    for reward in (graded, strict):
        monkeypatch.setattr(reward, "detect", fake_detections(scene))
    metas = [METAS[0], METAS[3], {"tag": "counting", "include": [{"class": "dog", "count": 2}]}]
    batch = images(3)
    # Three dogs (counting thresholds pass at 0.95): 2 asked -> 0.5; exclude at 3 fails strict.
    # Position: three dogs for one asked -> terms [1, -1, 0.0], mean 0;
    # strict takes the top dog, left of the person -> correct.
    torch.testing.assert_close(graded(batch, ["p"] * 3, metas), torch.tensor([0.5, 0.0, 0.5]))
    torch.testing.assert_close(strict(batch, ["p"] * 3, metas), torch.tensor([0.0, 1.0, 1.0]))


def test_missing_weights_raise_with_instructions(weights, tmp_path, monkeypatch):
    with pytest.raises(MissingWeightsError, match="mask2former-swin-small-coco-instance"):
        GenEval()
    with pytest.raises(MissingWeightsError, match="does not exist"):
        GenEval(path=tmp_path / "nowhere")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(MissingWeightsError, match=r"preprocessor_config\.json"):
        GenEvalStrict(path=tmp_path)
    with pytest.raises(MissingWeightsError, match="clip-vit-large-patch14"):
        GenEval(path=weights["path"], clip_path=tmp_path / "no_clip")
    # Without clip_path the reward works until a prompt names a color.
    reward = GenEval(path=weights["path"], detector_size=64)
    monkeypatch.setattr(reward, "detect", fake_detections({"cat": [(0, 0, 8, 8)]}))
    assert reward(images(1), ["p"], [METAS[0]]).item() == 0.0
    with pytest.raises(MissingWeightsError, match="clip_path"):
        reward(images(1), ["p"], [METAS[2]])


def test_unknown_class_and_bad_options_are_errors(weights):
    reward = GenEval(path=weights["path"], detector_size=64)
    with pytest.raises(ValueError, match="'zebra' is not one the detector knows"):
        reward(images(1), ["p"], [{"include": [{"class": "zebra", "count": 1}]}])
    with pytest.raises(ValueError, match="geneval: GenEval metadata"):
        reward(images(1), ["p"], [{"include": [{"class": "dog", "count": 0}]}])
    with pytest.raises(ValueError, match="thresholds"):
        GenEval(path=weights["path"], threshold=1.5)
