"""GDPO as a strategy: the combined advantage against numpy and TRL's code, the strategy's
one objective, its config errors, and a tiny training run."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from mogradient_diffusion.advantages import gdpo_advantages
from mogradient_diffusion.cli import main
from mogradient_diffusion.runs.metrics_log import read_metrics
from mogradient_diffusion.strategies import build_strategy
from mogradient_diffusion.strategies.reward_weights import RewardWeightsSettings
from mogradient_diffusion.training_config import ConfigError, load_config

NAN = math.nan
EPS = 1e-4  # the official TRL code's, per group and for the batch


def numpy_gdpo(rewards: np.ndarray, groups: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The definition, one reward and one group at a time (see ``gdpo_advantages``)."""
    per_reward = np.zeros(rewards.shape)
    for k in range(rewards.shape[1]):
        for g in np.unique(groups):
            rows = np.flatnonzero((groups == g) & ~np.isnan(rewards[:, k]))
            values = rewards[rows, k]
            if len(values) < 2 or values.max() == values.min():
                continue  # no spread: A_k = 0 (not applicable: 0 as well)
            per_reward[rows, k] = (values - values.mean()) / (values.std(ddof=1) + EPS)
    summed = per_reward @ weights
    applies = (~np.isnan(rewards) & (weights > 0)).any(axis=1)
    out = np.full(len(rewards), np.nan)
    kept = summed[applies]
    out[applies] = (kept - kept.mean()) / (kept.std(ddof=1) + EPS)
    return out


def _rewards() -> tuple[torch.Tensor, torch.Tensor]:
    """Four prompt groups of four samples, three rewards. Reward 2 does not apply to
    group 1 (NaN for the whole group), reward 0 misses one sample of group 3, reward 1
    is constant in group 2, and sample 13 has no reward with positive weight (NaN x2;
    reward 2 has weight 0 in the tests that use it)."""
    generator = torch.Generator().manual_seed(0)
    rewards = torch.rand(16, 3, generator=generator, dtype=torch.float64)
    rewards[:, 1] *= 10  # a reward on another scale: GDPO normalizes it away
    rewards[4:8, 2] = NAN
    rewards[14, 0] = NAN
    rewards[8:12, 1] = 3.0
    rewards[13, :2] = NAN
    groups = torch.tensor([7, 7, 7, 7, 2, 2, 2, 2, 5, 5, 5, 5, 0, 0, 0, 0])
    return rewards, groups


@pytest.mark.parametrize("weights", [[1.0, 1.0, 1.0], [2.0, 0.5, 0.0]])
def test_combined_advantage_matches_a_numpy_computation(weights: list[float]) -> None:
    rewards, groups = _rewards()
    expected = numpy_gdpo(rewards.numpy(), groups.numpy(), np.array(weights))
    combined = gdpo_advantages(rewards, groups, weights)
    assert combined.dtype == torch.float32 and combined.shape == (16,)
    np.testing.assert_allclose(combined.numpy(), expected, rtol=1e-5, atol=1e-6)
    # Only sample 13 with weight 0 on the one reward it has sits out; every group's
    # advantages average to 0, so an objective's group centering changes nothing.
    assert torch.isnan(combined).nonzero().flatten().tolist() == ([13] if weights[2] == 0 else [])
    for group in groups.unique():
        values = combined[(groups == group) & ~torch.isnan(combined)]
        assert abs(values.double().mean().item()) < 1e-6


def test_agrees_with_the_official_trl_code_where_nan_covers_whole_groups() -> None:
    """TRL's apply_gdpo (NVlabs/GDPO grpo_trainer.py) transcribed: NaN rewards set to 0
    first, per-group mean and unbiased std of consecutive groups, nansum, batch norm."""
    rewards, _ = _rewards()
    rewards[14, 0] = 0.3  # no partial NaN within a group, every sample has a reward
    rewards[13, :2] = torch.tensor([0.1, 4.0], dtype=torch.float64)
    size, weights = 4, torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)
    filled = torch.nan_to_num(rewards)
    columns = []
    for k in range(3):
        reward = filled[:, k]
        mean = reward.view(-1, size).mean(dim=1).repeat_interleave(size)
        std = reward.view(-1, size).std(dim=1).repeat_interleave(size)
        columns.append((reward - mean) / (std + 1e-4))
    pre = (torch.stack(columns, dim=1) * weights).nansum(dim=1)
    trl = (pre - pre.mean()) / (pre.std() + 1e-4)
    groups = torch.arange(4).repeat_interleave(size)
    combined = gdpo_advantages(rewards, groups, weights)
    torch.testing.assert_close(combined, trl.float(), rtol=1e-5, atol=1e-6)


def test_a_batch_without_spread_gives_exact_zeros() -> None:
    rewards = torch.tensor([[0.1, NAN], [0.1, NAN], [0.7, 2.0], [0.7, 2.0]])
    combined = gdpo_advantages(rewards, torch.tensor([0, 0, 1, 1]), [1.0, 1.0])
    assert torch.equal(combined, torch.zeros(4))


def test_the_strategy_is_one_objective_without_a_solve() -> None:
    rewards, groups = _rewards()
    settings = RewardWeightsSettings(weights=[2.0, 0.5, 0.0])
    strategy = build_strategy("gdpo", settings, ["a", "b", "c"])
    assert strategy.objective_names(epoch=0) == ["a+b"]
    assert strategy.gradient_free and not strategy.needs_gradients()
    column = strategy.objective_rewards(rewards, epoch=0, group_ids=groups)
    assert column.shape == (16, 1)
    expected = gdpo_advantages(rewards, groups, [2.0, 0.5, 0.0])
    torch.testing.assert_close(column[:, 0], expected, rtol=0, atol=0, equal_nan=True)
    equal = build_strategy("gdpo", RewardWeightsSettings(), ["a", "b", "c"])
    assert equal.scalar_weights.tolist() == [1.0, 1.0, 1.0]
    # Group normalization needs the batch's group ids and per-sample rewards.
    with pytest.raises(ValueError, match="normalizes each reward within its prompt group"):
        strategy.objective_rewards(rewards, epoch=0)
    with pytest.raises(ValueError, match=r"got rewards \(4, 4, 3\)"):
        strategy.objective_rewards(rewards.reshape(4, 4, 3), epoch=0, group_ids=groups)


@pytest.mark.parametrize(
    ("weights", "match"),
    [
        ([1.0], "1 entries for 2 rewards"),
        ([1.0, -1.0], "finite, >= 0 and not all zero"),
        ([0.0, 0.0], "finite, >= 0 and not all zero"),
        ([1.0, NAN], "finite, >= 0 and not all zero"),
    ],
)
def test_build_refuses_bad_weights(weights: list[float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_strategy("gdpo", RewardWeightsSettings(weights=weights), ["a", "b"])


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["strategy.weights=[1]"], "strategy.weights has 1 entries for 2 rewards"),
        (["strategy.weights=[1, -1]"], "strategy.weights must be finite, >= 0 and not all zero"),
        (["strategy.weights=[0, 0]"], "strategy.weights must be finite, >= 0 and not all zero"),
        (["strategy.weights=[1, .inf]"], "finite"),
        (["strategy.rho=0.7"], "does not use strategy.rho"),
        (["objective.advantage_std=group"], "advantage_std=group would normalize it per prompt"),
        (["objective.name=sdpo"], "objective 'sdpo' works on dense per-step rewards"),
    ],
)
def test_config_errors(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match) as error:
        load_config(preset="tiny", overrides=["strategy.name=gdpo", *overrides])
    assert "\n" not in str(error.value)


def test_config_takes_gdpo_with_or_without_weights() -> None:
    config = load_config(preset="tiny", overrides=["strategy.name=gdpo"])
    assert config.strategy.settings.weights is None
    config = load_config(preset="tiny", overrides=["strategy.name=gdpo", "strategy.weights=[2, 1]"])
    assert config.strategy.settings.weights == [2.0, 1.0]


@pytest.mark.parametrize(
    "overrides",
    [
        ["train.epochs=2"],
        [
            "train.epochs=1",
            "objective.name=flow_grpo",
            "rollout.sampler=sde",
            "train.old_schedule=copy",
        ],
    ],
    ids=["nft", "flow_grpo"],
)
def test_tiny_run_trains_one_combined_objective(tmp_path: Path, overrides: list[str]) -> None:
    run_dir = tmp_path / "run"
    arguments = ["train", "--preset", "tiny", f"run.directory={run_dir}", "run.quiet=true"]
    assert main([*arguments, *overrides, "strategy.name=gdpo"]) == 0
    records = read_metrics(run_dir)
    assert len(records) == int(overrides[0][-1])
    name = "color_match+jpeg_incompressibility"
    for record in records:
        assert record["objectives"] == [name]
        for step in record["optimizer_steps"]:
            assert step["solved"] == 0 and step["weights"] == [1.0]
            if step.get("skipped") != "no reward signal":
                assert math.isfinite(step["grad_norm"])
        # The combined advantage: group mean 0 and (population) batch std 1, unclipped
        # with 8 samples; silent (all 0) only if no reward varied within a group.
        mean, std = record[f"advantage/{name}/adv_mean"], record[f"advantage/{name}/adv_std"]
        assert abs(mean) < 1e-6
        assert std == pytest.approx(1.0, abs=1e-3) or std == 0.0
        assert record[f"advantage/{name}/clip_fraction"] == 0.0
