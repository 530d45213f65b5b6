"""Group advantages against hand values and a loop-by-loop numpy reference; weighted sum."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mogradient_diffusion.advantages import group_advantages, weighted_reward

NAN = math.nan


def reference(rewards: np.ndarray, groups: np.ndarray, std: str, clip, eps: float) -> np.ndarray:
    """The definition, one reward and one group at a time."""
    out = np.full(rewards.shape, np.nan)
    for k in range(rewards.shape[1]):
        column = rewards[:, k]
        global_std = np.nanstd(column) if not np.isnan(column).all() else np.nan
        for g in np.unique(groups):
            rows = (groups == g) & ~np.isnan(column)
            if not rows.any():
                continue
            values = column[rows]
            scale = global_std if std == "global" else values.std()
            out[rows, k] = (values - values.mean()) / (scale + eps)
    return out if clip is None else np.clip(out, -clip, clip)


def test_hand_computed_example():
    # Group 0: {1, 3}; group 1: {2, 2} (zero std); group 2: {NaN, 5} (one value present).
    rewards = torch.tensor([[1.0], [3.0], [2.0], [2.0], [NAN], [5.0]])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    global_std = math.sqrt(9.2 / 5)  # present values 1, 3, 2, 2, 5 have mean 2.6
    adv, stats = group_advantages(rewards, groups)
    one = 1 / (global_std + 1e-6)
    torch.testing.assert_close(adv[:, 0], torch.tensor([-one, one, 0, 0, NAN, 0]), equal_nan=True)
    assert stats["reward_mean"].item() == pytest.approx(2.6)
    assert stats["reward_std"].item() == pytest.approx(global_std)
    assert stats["present_fraction"].item() == pytest.approx(5 / 6)
    assert stats["zero_std_group_ratio"].item() == pytest.approx(2 / 3)
    assert stats["adv_abs_mean"].item() == pytest.approx(2 * one / 5, rel=1e-6)
    assert stats["adv_min"].item() == pytest.approx(-one, rel=1e-6)
    assert stats["adv_max"].item() == pytest.approx(one, rel=1e-6)

    adv, _ = group_advantages(rewards, groups, std="group")
    expected = torch.tensor([-1 / (1 + 1e-6), 1 / (1 + 1e-6), 0, 0, NAN, 0])
    torch.testing.assert_close(adv[:, 0], expected, equal_nan=True)


@pytest.mark.parametrize("std", ["global", "group"])
@pytest.mark.parametrize("clip", [None, 1.0, 5.0])
def test_matches_numpy_reference(std, clip):
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=(24, 3)) * [1.0, 10.0, 0.1]
    rewards[rng.random((24, 3)) < 0.2] = np.nan
    rewards[:, 2][:8] = np.nan  # a reward absent from whole groups
    rewards[8:12, 1] = 0.7  # a zero-std group in reward 1
    groups = np.repeat([5, 3, 9, 1, 7, 2], 4)
    order = rng.permutation(24)  # groups need not be contiguous
    rewards, groups = rewards[order], groups[order]
    adv, _ = group_advantages(
        torch.tensor(rewards, dtype=torch.float32), torch.tensor(groups), std=std, clip=clip
    )
    expected = reference(rewards.astype(np.float32).astype(np.float64), groups, std, clip, 1e-6)
    np.testing.assert_allclose(adv.numpy(), expected, rtol=1e-5, atol=1e-6)
    assert adv.dtype == torch.float32


def test_clipping_and_its_stats():
    rewards = torch.tensor([[0.0], [0.0], [0.0], [0.0], [0.0], [0.0], [0.0], [100.0]])
    groups = torch.zeros(8, dtype=torch.long)
    free, _ = group_advantages(rewards, groups, clip=None)
    assert free.max().item() == pytest.approx(math.sqrt(7), rel=1e-5)  # (100 - 12.5) / 33.07
    clipped, stats = group_advantages(rewards, groups, clip=1.0)
    assert clipped.max().item() == 1.0
    assert stats["clip_fraction"].item() == pytest.approx(1 / 8)
    assert stats["adv_max"].item() == 1.0


def test_all_nan_reward_and_constant_batch():
    rewards = torch.tensor([[NAN, 1.0], [NAN, 1.0], [NAN, 1.0], [NAN, 1.0]])
    adv, stats = group_advantages(rewards, torch.tensor([0, 0, 1, 1]))
    assert torch.isnan(adv[:, 0]).all()
    assert torch.equal(adv[:, 1], torch.zeros(4))  # no signal, and no division blow-up
    assert stats["present_fraction"].tolist() == [0.0, 1.0]
    for key in ("reward_mean", "reward_std", "zero_std_group_ratio", "adv_mean", "adv_max"):
        assert math.isnan(stats[key][0].item()), key
    assert stats["zero_std_group_ratio"][1].item() == 1.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"std": "batch"}, "std must be one of"),
        ({"clip": 0.0}, "clip must be > 0"),
        ({"eps": 0.0}, "eps must be > 0"),
    ],
)
def test_option_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(torch.zeros(2, 1), torch.zeros(2, dtype=torch.long), **kwargs)


def test_shape_and_value_errors():
    with pytest.raises(ValueError, match=r"\[B, K\]"):
        group_advantages(torch.zeros(4), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(torch.zeros(4, 2), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="inf"):
        group_advantages(torch.tensor([[math.inf], [0.0]]), torch.zeros(2, dtype=torch.long))


def test_weighted_reward():
    rewards = torch.tensor([[1.0, 3.0], [NAN, 3.0], [NAN, NAN], [2.0, NAN]])
    torch.testing.assert_close(
        weighted_reward(rewards, [1.0, 3.0]), torch.tensor([2.5, 3.0, NAN, 2.0]), equal_nan=True
    )
    # A sample whose only present reward has weight 0 has no score.
    torch.testing.assert_close(
        weighted_reward(rewards, torch.tensor([0.0, 1.0])),
        torch.tensor([3.0, 3.0, NAN, NAN]),
        equal_nan=True,
    )
    with pytest.raises(ValueError, match="3 weights for 2 rewards"):
        weighted_reward(rewards, [1, 1, 1])
    with pytest.raises(ValueError, match="weights must be"):
        weighted_reward(rewards, [1, -1])
    with pytest.raises(ValueError, match="weights must be"):
        weighted_reward(rewards, [0, 0])
