"""The objective interface: registry, config section, NFT as an objective, [B, S, K] masks."""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext

import pytest
import torch

from mogradient_diffusion.advantages import weighted_reward
from mogradient_diffusion.model.embeddings import PromptEmbeddings
from mogradient_diffusion.objectives import (
    OBJECTIVES,
    Objective,
    StepMetrics,
    TrainPiece,
    UnknownObjectiveError,
    build_objective,
    objective_class,
)
from mogradient_diffusion.objectives.nft import NFTObjective, NFTRollout, NFTSettings
from mogradient_diffusion.strategies import build_strategy
from mogradient_diffusion.strategies.reward_weights import RewardWeightsSettings
from mogradient_diffusion.training.trainer import has_signal, mask_objectives
from mogradient_diffusion.training_config import ConfigError, load_config


def test_registry_builds_nft_and_refuses_unknown_names_and_wrong_settings() -> None:
    assert objective_class("nft") is NFTObjective
    objective = build_objective("nft", NFTSettings(beta=0.5))
    assert isinstance(objective, Objective) and objective.settings.beta == 0.5
    with pytest.raises(UnknownObjectiveError, match="unknown objective 'ppo'"):
        objective_class("ppo")
    with pytest.raises(UnknownObjectiveError, match="did you mean 'flow_grpo'"):
        objective_class("flowgrpo")
    with pytest.raises(TypeError, match="takes NFTSettings"):
        build_objective("nft", RewardWeightsSettings())


def test_each_objective_is_registered_under_its_own_name() -> None:
    """The registry imports a module on first use; the class it finds has that name."""
    assert list(OBJECTIVES) == ["nft", "flow_grpo", "sdpo"]
    for name in OBJECTIVES:
        assert objective_class(name).name == name


def test_objective_section_is_the_objectives_own_settings() -> None:
    config = load_config(
        preset="tiny", overrides=["objective.beta=0.5", "objective.advantage_std=group"]
    )
    assert config.objective.settings == NFTSettings(beta=0.5, advantage_std="group")
    plain = config.to_dict()["objective"]
    assert plain == {"name": "nft", **NFTSettings(beta=0.5, advantage_std="group").__dict__}
    with pytest.raises(ConfigError, match=r"objective\.advantage_std must be one of"):
        load_config(preset="tiny", overrides=["objective.advantage_std=batch"])
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['nft'\].*'objective'"):
        load_config(preset="tiny", overrides=["nft.beta=0.5"])


def test_nft_holds_no_state() -> None:
    objective = NFTObjective(NFTSettings())
    assert objective.state_dict() == {}
    objective.load_state_dict({})
    with pytest.raises(ValueError, match="keeps no state"):
        objective.load_state_dict({"tracker": 1})


class LinearPolicy:
    """v = a_adapter * x for each adapter; records the noisy inputs it was given."""

    def __init__(self, trained: float, old: float) -> None:
        self.scale = {
            "default": torch.nn.Parameter(torch.tensor(trained, dtype=torch.float64)),
            "old": torch.tensor(old),
            "reference": torch.tensor(0.0),
        }
        self.inputs: list[torch.Tensor] = []
        self.sigmas: list[torch.Tensor] = []

    def velocity(self, x, sigma, embeds, adapter="default"):
        if adapter == "default":
            self.inputs.append(x)
            self.sigmas.append(sigma)
        context = nullcontext() if adapter == "default" else torch.no_grad()
        with context:
            return self.scale[adapter] * x


def _rollout(rows: int = 6) -> NFTRollout:
    return NFTRollout(
        prompts=[f"p{i // 3}" for i in range(rows)],
        group_ids=torch.arange(rows) // 3,
        images=torch.zeros(rows, 3, 2, 2),
        latents=torch.randn(rows, 2, 2, 2, generator=torch.Generator().manual_seed(0)),
        embeds=PromptEmbeddings(torch.zeros(rows, 1, 1), torch.zeros(rows, 1)),
        sigmas=torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]),
        timesteps=2,
    )


@pytest.mark.parametrize(("trained", "old"), [(0.3, 0.3), (0.5, 0.3)])
def test_nft_logs_the_velocity_gap_to_the_old_policy(trained: float, old: float) -> None:
    """||v_theta - v_old||^2 is exactly 0 when the old adapter equals the trained one."""
    policy = LinearPolicy(trained, old)
    batch = _rollout()
    advantages = torch.tensor([[1.0], [-1.0], [0.5]]).repeat(2, 1)
    step = [TrainPiece(batch.rows(torch.tensor(r)), advantages[r]) for r in ([0, 1, 2], [3, 4, 5])]
    metrics = StepMetrics()
    pieces = list(NFTObjective(NFTSettings()).losses(policy, step, torch.Generator(), metrics))
    assert len(pieces) == 2 * 2  # pieces x trained levels, each weighted 1 / levels
    assert all(scale == 0.5 for scale, _ in pieces)
    gap = metrics.summary()["velocity_gap_to_old"]
    expected = torch.stack([((trained - old) * x).square().mean() for x in policy.inputs]).mean()
    if trained == old:
        assert gap == 0.0
    else:
        assert gap == pytest.approx(float(expected), rel=1e-6)


def _noise_draws(policy: LinearPolicy, step: list[TrainPiece]) -> dict[int, list[tuple]]:
    """Per rollout row: the (sigma, noise) of each trained level, recovered from the inputs."""
    calls = iter(zip(policy.inputs, policy.sigmas, strict=True))
    draws: dict[int, list[tuple]] = {}
    for piece, rows in step:
        for _ in range(piece.data.timesteps):
            x, sigma = next(calls)
            shaped = sigma.view(-1, 1, 1, 1)
            noise = (x - (1 - shaped) * piece.data.latents) / shaped
            for i, row in enumerate(rows):
                draws.setdefault(row, []).append((float(sigma[i]), noise[i]))
    return draws


def test_shared_noise_gives_every_row_of_a_group_its_groups_draws() -> None:
    batch = _rollout()  # groups: rows 0-2 and 3-5
    split = ([0, 3, 4], [1, 5, 2])  # each group spread over both micro-batches
    advantages = torch.tensor([[1.0], [-1.0], [0.5], [0.2], [-0.4], [0.2]])
    step = [TrainPiece(batch.rows(torch.tensor(r)), advantages[r]) for r in split]
    policy = LinearPolicy(0.3, 0.3)
    objective = NFTObjective(NFTSettings(shared_noise=True))
    list(objective.losses(policy, step, torch.Generator().manual_seed(1), StepMetrics()))
    draws = _noise_draws(policy, list(zip(step, split, strict=True)))
    for group in ([0, 1, 2], [3, 4, 5]):
        first = draws[group[0]]
        assert len({sigma for sigma, _ in first}) == len(first)  # distinct levels per row
        for row in group[1:]:
            for (sigma, noise), (first_sigma, first_noise) in zip(draws[row], first, strict=True):
                assert sigma == first_sigma and torch.allclose(noise, first_noise, atol=1e-5)
    assert not torch.allclose(draws[0][0][1], draws[3][0][1], atol=1e-2)


def _gradient(settings: NFTSettings, batch: NFTRollout, advantages: torch.Tensor) -> float:
    policy = LinearPolicy(0.5, 0.3)  # trained != old: the loss has an advantage-free part
    step = [TrainPiece(batch, advantages)]
    generator = torch.Generator().manual_seed(2)
    pieces = NFTObjective(settings).losses(policy, step, generator, StepMetrics())
    total = sum(scale * loss.combined([1.0]) for scale, loss in pieces)
    return float(torch.autograd.grad(total, policy.scale["default"])[0])


@pytest.mark.parametrize("shared", [False, True])
def test_shared_noise_cancels_what_a_group_has_in_common(shared: bool) -> None:
    """Groups of identical samples under zero-sum advantages carry no signal. With shared
    draws the advantage terms of a group's rows cancel exactly, so the gradient is that of
    zero advantages; with draws per row they cancel only in expectation."""
    batch = _rollout()
    batch = dataclasses.replace(batch, latents=batch.latents[[0, 0, 0, 3, 3, 3]].double())
    advantages = torch.tensor([[1.0], [-1.0], [0.0], [0.5], [0.0], [-0.5]], dtype=torch.float64)
    settings = NFTSettings(shared_noise=shared, kl_coefficient=0.0)
    with_advantages = _gradient(settings, batch, advantages)
    without = _gradient(settings, batch, torch.zeros_like(advantages))
    if shared:  # float64: equal up to the rounding of a few dozen terms
        assert with_advantages == pytest.approx(without, rel=1e-12)
    else:
        assert abs(with_advantages - without) > 1e-3 * abs(without)


def test_rollout_rows_select_samples_and_keep_the_schedule() -> None:
    batch = _rollout()
    rows = batch.rows(torch.tensor([4, 1]))
    assert rows.prompts == ["p1", "p0"] and rows.group_ids.tolist() == [1, 0]
    assert torch.equal(rows.latents, batch.latents[[4, 1]])
    assert torch.equal(rows.sigmas, batch.sigmas) and rows.timesteps == batch.timesteps


def test_silent_objectives_are_found_per_sample_and_per_step() -> None:
    advantages = torch.zeros(3, 4, 2)  # [B, S, K]
    advantages[2, 3, 1] = 0.5
    advantages[0, 0, 0] = float("nan")
    assert has_signal(advantages).tolist() == [False, True]
    masked = mask_objectives(advantages, ~has_signal(advantages))
    assert torch.isnan(masked[..., 0]).all() and torch.equal(masked[..., 1], advantages[..., 1])
    assert has_signal(advantages[:, 0]).tolist() == [False, False]  # [B, K]


def test_scalar_strategies_map_per_step_rewards_like_per_sample_ones() -> None:
    rewards = torch.rand(3, 4, 2, generator=torch.Generator().manual_seed(0))
    rewards[1, 2, 0] = float("nan")
    settings = RewardWeightsSettings(weights=[2.0, 1.0])
    strategy = build_strategy("weighted_sum", settings, ["a", "b"])
    mapped = strategy.objective_rewards(rewards, epoch=0)
    assert mapped.shape == (3, 4, 1)
    for step in range(4):
        expected = weighted_reward(rewards[:, step], [2.0, 1.0])
        assert torch.equal(mapped[:, step, 0], expected)
