"""The Flow-GRPO SDE step and sampler against closed forms, float64 densities and the tiny SD3."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from tolerances import chain_atol, eps

from mogradient_diffusion.model.policy import LoraSpec, Policy
from mogradient_diffusion.model.schedules import sampler_sigmas
from mogradient_diffusion.objectives.step_rollout import flow_grpo_steps
from mogradient_diffusion.sampling.rollout import guided_velocity, paired_noise
from mogradient_diffusion.sampling.sde import (
    gaussian_log_prob,
    noise_scale,
    sde_step_statistics,
    transition_log_prob,
)
from mogradient_diffusion.sampling.solver import integrate

from .rollouts import rescored_log_prob

MAX_TOKENS = 32


def _oracle_log_prob(x, v, x_next, t: float, t_next: float, sigma_max: float, eta: float):
    """The step's Gaussian in float64 from the issue's formulas, scored by torch.distributions."""
    x, v, x_next = (a.double() for a in (x, v, x_next))
    scale = eta * math.sqrt(t / (1 - (sigma_max if t == 1 else t)))
    dt = t_next - t
    mean = x * (1 + scale**2 * dt / (2 * t)) + v * (1 + scale**2 * (1 - t) / (2 * t)) * dt
    density = torch.distributions.Normal(mean, scale * math.sqrt(-dt))
    return density.log_prob(x_next).flatten(1).mean(dim=1), mean


@pytest.mark.parametrize("eta", [0.3, 0.7, 1.0])
@pytest.mark.parametrize("step", [0, 3, 8])
def test_log_prob_is_the_float64_gaussian_density(eta: float, step: int) -> None:
    sigmas = sampler_sigmas(10, 3.0)  # step 0 is at t = 1, where sigmas[1] stands in
    t, t_next, sigma_max = float(sigmas[step]), float(sigmas[step + 1]), float(sigmas[1])
    generator = torch.Generator().manual_seed(step)
    x, v, noise = (torch.randn(3, 4, 8, 8, generator=generator, dtype=torch.float64) for _ in "xvn")
    oracle_mean = _oracle_log_prob(x, v, x, t, t_next, sigma_max, eta)[1]
    std = eta * math.sqrt(t / (1 - (sigma_max if t == 1 else t))) * math.sqrt(t - t_next)
    x_next = oracle_mean + std * noise
    expected, _ = _oracle_log_prob(x, v, x_next, t, t_next, sigma_max, eta)

    exact, mean, scale = transition_log_prob(x, v, x_next, t, t_next, sigma_max, eta)
    assert exact.dtype == torch.float64
    torch.testing.assert_close(exact, expected, rtol=0, atol=chain_atol(torch.float64, 100, 64))
    torch.testing.assert_close(mean, oracle_mean, rtol=0, atol=chain_atol(torch.float64, 10, 16))
    expected_scale = eta * math.sqrt(t / (1 - (sigma_max if t == 1 else t)))
    assert scale.flatten().tolist() == pytest.approx(
        [expected_scale] * 3, rel=4 * eps(torch.float64)
    )

    # the float32 path: every input rounded once, then ~ten float32 operations on each entry.
    # A relative error e in the mean moves the z-score by |mean| e / std, the log-density
    # by |z| |mean| e / std; std and log std carry a few ulps of their own.
    low, _, _ = transition_log_prob(x.float(), v.float(), x_next.float(), t, t_next, sigma_max, eta)
    assert low.dtype == torch.float32
    z = noise.abs().amax().item()
    size = (x.abs() + v.abs() + x_next.abs()).amax().item()
    tolerance = 16 * eps(torch.float32) * (z * size / std + z * z + abs(math.log(std)) + 1)
    torch.testing.assert_close(low.double(), expected, rtol=0, atol=tolerance)


def test_eta_zero_is_euler_and_has_no_density() -> None:
    x, v = torch.randn(2, 4, 4, 4), torch.randn(2, 4, 4, 4)
    mean, std, _ = sde_step_statistics(x, v, 0.6, 0.4, 0.9, 0.0)
    torch.testing.assert_close(mean, x + (0.4 - 0.6) * v)
    assert bool((std == 0).all())
    with pytest.raises(ValueError, match="no density"):
        gaussian_log_prob(mean, mean, std)


def test_step_input_validation() -> None:
    x = torch.zeros(2, 4, 2, 2)
    with pytest.raises(ValueError, match="sigma_next < sigma"):
        sde_step_statistics(x, x, 0.4, 0.6, 0.9, 0.7)
    with pytest.raises(ValueError, match="share a shape"):
        sde_step_statistics(x, x[:1], 0.6, 0.4, 0.9, 0.7)
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        sde_step_statistics(x, x, torch.tensor([0.6, 0.5, 0.4]), 0.3, 0.9, 0.7)
    with pytest.raises(ValueError, match="sigma_max"):
        noise_scale(torch.tensor(1.0), 1.0, 0.7)
    with pytest.raises(ValueError, match="eta"):
        noise_scale(torch.tensor(0.5), 0.9, -0.1)


@pytest.mark.parametrize("eta", [0.0, 0.7, 1.0])
@pytest.mark.parametrize("data_std", [0.5, 2.0])
def test_gaussian_toy_with_exact_velocity_ends_at_the_data_std(eta: float, data_std: float) -> None:
    """x0 ~ N(0, s^2): E[noise - x0 | x_t] = (t - (1 - t) s^2) / ((1 - t)^2 s^2 + t^2) x_t.

    The SDE preserves the marginals, so every eta must end at std s; 400 steps on the
    shift-3 schedule leave the Euler(-Maruyama) bias at ~0.5%, 10^5 samples a 0.2% error.
    """

    def velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        t = t.double().reshape(-1, 1, 1, 1)
        variance = (1 - t) ** 2 * data_std**2 + t**2
        return (t - (1 - t) * data_std**2) / variance * x.double()

    generator = torch.Generator().manual_seed(1)
    noise = torch.randn(100_000, 1, 1, 1, generator=generator)
    steps = 400
    result = integrate(velocity, noise, sampler_sigmas(steps, 3.0), "sde", eta, generator)
    assert result.final.std().item() / data_std == pytest.approx(1.0, abs=0.01)


def test_flow_grpo_steps_full_and_window() -> None:
    assert flow_grpo_steps(10, 0.99) == (list(range(10)), list(range(9)))
    assert flow_grpo_steps(10, 0.5) == (list(range(10)), list(range(5)))
    starts = set()
    for seed in range(40):
        sde, trained = flow_grpo_steps(
            10, window_size=3, window_range=(0, 5), generator=torch.Generator().manual_seed(seed)
        )
        assert sde == trained and len(sde) == 3 and sde == list(range(sde[0], sde[0] + 3))
        starts.add(sde[0])
    assert starts == {0, 1, 2}
    with pytest.raises(ValueError, match="window_size"):
        flow_grpo_steps(10, window_size=6, window_range=(0, 5))
    with pytest.raises(ValueError, match="trains no step"):
        flow_grpo_steps(1, 0.5)


def _linear_velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return -0.5 * x + t.reshape(-1, 1, 1, 1)


def test_window_sampler_is_ode_outside_and_records_window_steps() -> None:
    sigmas = sampler_sigmas(6, 3.0)
    noise = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(0))
    result = integrate(
        _linear_velocity,
        noise,
        sigmas,
        "sde",
        0.7,
        torch.Generator().manual_seed(1),
        sde_steps=[2, 3],
        recorded_steps=[2, 3],
        record_x0=True,
    )
    assert result.latents.shape == (2, 2, 4, 4, 4) and result.log_probs.shape == (2, 2)
    assert result.steps.tolist() == [2, 3] and result.predicted_x0.shape == (2, 6, 4, 4, 4)
    x = noise.clone()
    for i in range(2):  # ODE (Euler) up to the window
        x = x + (sigmas[i + 1] - sigmas[i]) * _linear_velocity(x, sigmas[i].expand(2))
    torch.testing.assert_close(result.latents[:, 0], x)
    torch.testing.assert_close(result.latents[:, 1], result.next_latents[:, 0])
    t = sigmas[2].expand(2)
    torch.testing.assert_close(result.predicted_x0[:, 2], x - sigmas[2] * _linear_velocity(x, t))
    for j, i in enumerate((2, 3)):
        expected, _, _ = transition_log_prob(
            result.latents[:, j],
            _linear_velocity(result.latents[:, j], sigmas[i].expand(2)),
            result.next_latents[:, j],
            sigmas[i],
            sigmas[i + 1],
            float(sigmas[1]),
            0.7,
        )
        torch.testing.assert_close(result.log_probs[:, j], expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="not SDE steps"):
        integrate(_linear_velocity, noise, sigmas, "sde", sde_steps=[2], recorded_steps=[2, 3])


def test_pairs_share_the_start_and_draw_their_own_noise() -> None:
    noise = paired_noise(torch.randn(3, 4, 4, 4, generator=torch.Generator().manual_seed(0)))
    assert noise.shape == (6, 4, 4, 4)
    assert torch.equal(noise[0], noise[1]) and torch.equal(noise[4], noise[5])
    assert not torch.equal(noise[1], noise[2])
    result = integrate(
        _linear_velocity,
        noise,
        sampler_sigmas(4, 3.0),
        "sde",
        0.7,
        torch.Generator().manual_seed(1),
        recorded_steps=range(3),
    )
    assert torch.equal(result.latents[0, 0], result.latents[1, 0])
    assert not torch.allclose(result.next_latents[0, 0], result.next_latents[1, 0])


@pytest.fixture(scope="module")
def policy(tiny_pipeline_dir: Path) -> Policy:
    """A tiny SD3 whose trained adapter (and the identical old one) differs from the base."""
    policy = Policy.load(tiny_pipeline_dir, LoraSpec(rank=4, alpha=8))
    generator = torch.Generator().manual_seed(0)
    state = policy.lora_state("default")
    perturbed = {k: 0.1 * torch.randn(v.shape, generator=generator) for k, v in state.items()}
    policy.load_lora_state("default", perturbed)
    policy.load_lora_state("old", perturbed)
    return policy


def test_training_time_log_prob_reproduces_the_rollout_and_ratio_is_one(policy: Policy) -> None:
    """Rescoring each recorded step with the trained adapter (grad on, CFG's uncond branch
    detached) gives the rollout's log p_old: r == 1 before any update; after one it moves."""
    embeds = policy.encode_prompts(["a red cat", "a blue dog"], MAX_TOKENS).repeat_interleave(2)
    negative = policy.encode_prompts([""], MAX_TOKENS).repeat_interleave(4)
    noise = paired_noise(
        torch.randn(2, *policy.latent_shape(64), generator=torch.Generator().manual_seed(0))
    )
    sigmas = sampler_sigmas(6, 3.0)
    sampler = guided_velocity(policy, embeds, negative, 4.5, "default")
    result = integrate(
        sampler,
        noise,
        sigmas,
        "sde",
        0.7,
        torch.Generator().manual_seed(1),
        recorded_steps=range(5),
    )

    def rescored(step: int) -> torch.Tensor:
        velocity = guided_velocity(policy, embeds, negative, 4.5, "default", detach_uncond=True)
        return rescored_log_prob(result, velocity, sigmas, step, 0.7)

    for step in range(5):
        ratio = torch.exp(rescored(step) - result.log_probs[:, step])
        assert torch.equal(ratio.detach(), torch.ones(4)), f"step {step}: r = {ratio.tolist()}"

    params = policy.trainable_parameters()
    saved = [p.detach().clone() for p in params]
    try:
        with torch.no_grad():
            for p in params:
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
        moved = torch.exp(rescored(0) - result.log_probs[:, 0]).detach()
        assert (moved - 1).abs().max() > 1e-4
    finally:
        with torch.no_grad():
            for p, value in zip(params, saved, strict=True):
                p.copy_(value)
