"""The chunked CFG sampler and its ODE solvers on the tiny SD3 pipeline, checked against
diffusers and closed forms."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tolerances import chain_atol

from mogradient_diffusion.model.policy import LoraSpec, Policy
from mogradient_diffusion.model.schedules import sampler_sigmas
from mogradient_diffusion.sampling.rollout import RolloutBatch, rollout
from mogradient_diffusion.sampling.solver import integrate

PROMPTS = ["a red cat", 'a sign saying "hello"']
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def policy(tiny_pipeline_dir: Path) -> Policy:
    """A policy whose ``old`` adapter differs from the base model."""
    policy = Policy.load(tiny_pipeline_dir, LoraSpec(rank=4, alpha=8))
    generator = torch.Generator().manual_seed(0)
    state = policy.lora_state("old")
    policy.load_lora_state(
        "old", {k: 0.1 * torch.randn(v.shape, generator=generator) for k, v in state.items()}
    )
    return policy


def _noise(policy: Policy, count: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count, *policy.latent_shape(64), generator=generator)


def _rollout(policy: Policy, images_per_prompt: int, steps: int, **kwargs) -> RolloutBatch:
    return rollout(
        policy,
        PROMPTS,
        images_per_prompt,
        steps,
        resolution=64,
        max_sequence_length=MAX_TOKENS,
        **kwargs,
    )


@pytest.mark.parametrize("shift", [1.0, 3.0])
@pytest.mark.parametrize("steps", [1, 4, 10, 25, 40])
def test_sampler_sigmas_equal_the_diffusers_scheduler(steps: int, shift: float) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(steps)
    sigmas = sampler_sigmas(steps, shift)
    assert sigmas.shape == (steps + 1,) and sigmas[0] == 1 and sigmas[-1] == 0
    assert torch.equal(sigmas, scheduler.sigmas)


def test_euler_one_step_is_the_closed_form(policy: Policy) -> None:
    noise = _noise(policy, 2)
    batch = _rollout(policy, 1, 1, noise=noise)
    embeds = policy.encode_prompts(PROMPTS, MAX_TOKENS)
    expected = noise - policy.velocity(noise, 1.0, embeds, "old")
    torch.testing.assert_close(batch.latents, expected, rtol=0, atol=1e-6)
    assert torch.equal(batch.sigmas, torch.tensor([1.0, 0.0]))


@pytest.mark.parametrize("guidance_scale", [1.0, 3.0])
def test_euler_matches_the_diffusers_pipeline(policy, tiny_pipeline_dir, guidance_scale) -> None:
    from diffusers import StableDiffusion3Pipeline

    pipeline = StableDiffusion3Pipeline.from_pretrained(tiny_pipeline_dir)
    pipeline.set_progress_bar_config(disable=True)
    noise = _noise(policy, 4)
    batch = _rollout(policy, 2, 4, noise=noise, adapter="reference", guidance_scale=guidance_scale)
    options = dict(
        prompt=PROMPTS,
        num_images_per_prompt=2,
        num_inference_steps=4,
        guidance_scale=guidance_scale,
        height=64,
        width=64,
        latents=noise,
        max_sequence_length=MAX_TOKENS,
    )
    latents = pipeline(**options, output_type="latent").images
    torch.testing.assert_close(batch.latents, latents, rtol=0, atol=1e-5)
    images = pipeline(**options, output_type="pt").images
    torch.testing.assert_close(batch.images, images, rtol=0, atol=1e-5)


def test_sde_without_noise_is_euler_and_with_noise_is_seeded(policy: Policy) -> None:
    noise = _noise(policy, 2)
    euler = _rollout(policy, 1, 3, noise=noise)
    quiet = _rollout(policy, 1, 3, noise=noise, sampler="sde", noise_level=0.0)
    assert torch.equal(quiet.latents, euler.latents)
    noisy = [
        _rollout(policy, 1, 3, sampler="sde", generator=torch.Generator().manual_seed(5))
        for _ in range(2)
    ]
    assert torch.equal(noisy[0].latents, noisy[1].latents)
    assert not torch.allclose(noisy[0].latents, euler.latents, atol=1e-3)


def test_dpm2_reduces_to_euler_at_the_ends_and_converges_at_second_order() -> None:
    """For x0 ~ N(0, c^2) the flow ODE maps x1 to exactly c * x1."""
    c = 1.0

    def velocity(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        sigma = sigma.double()[:, None]
        x0_mean = (1 - sigma) * c**2 / ((1 - sigma) ** 2 * c**2 + sigma**2) * x
        return (x - x0_mean) / sigma

    x1 = torch.randn(1, 64, generator=torch.Generator().manual_seed(0))
    for steps in (1, 2):  # from sigma = 1 and into sigma = 0 the update is first order
        sigmas = sampler_sigmas(steps)
        euler = integrate(velocity, x1, sigmas, "euler").final
        assert torch.equal(integrate(velocity, x1, sigmas, "dpm2").final, euler)

    def error(sampler: str, steps: int) -> float:
        final = integrate(velocity, x1, sampler_sigmas(steps), sampler).final
        return (final - c * x1).norm().item()

    assert 1.8 < error("euler", 80) / error("euler", 160) < 2.2
    assert error("dpm2", 80) / error("dpm2", 160) > 3.5
    assert error("dpm2", 80) < 0.5 * error("euler", 80)


def test_rollout_batch_shapes_grouping_and_chunking(policy: Policy) -> None:
    noise = _noise(policy, 6)
    whole = _rollout(policy, 3, 2, noise=noise, sampler="dpm2")
    chunked = _rollout(policy, 3, 2, noise=noise, sampler="dpm2", batch_size=4, progress=True)
    assert len(whole) == 6
    assert whole.prompts == [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3
    assert whole.group_ids.tolist() == [0, 0, 0, 1, 1, 1]
    assert whole.group_ids.dtype == torch.long
    assert whole.latents.shape == (6, 4, 8, 8)
    assert whole.images.shape == (6, 3, 64, 64)
    assert whole.images.min() >= 0 and whole.images.max() <= 1
    assert whole.sigmas.shape == (3,)
    assert len(whole.embeds) == 6
    assert torch.equal(whole.embeds.prompt_embeds[0], whole.embeds.prompt_embeds[2])
    assert not torch.equal(whole.embeds.pooled[0], whole.embeds.pooled[3])
    # Chunks of 4 + 2 rows are not bitwise the 6-row batch: MKL picks another GEMM kernel
    # for the 2-row matmuls (first seen in the timestep embedder's linear_1), so every
    # layer of every velocity may round differently (1-2 ulps of |v| seen on AMD EPYC).
    # Budget 16 ulps per evaluation for other CPUs and kernels, once per sampling step.
    latent_atol = chain_atol(torch.float32, whole.latents.abs().max(), ulps=16 * 2)
    torch.testing.assert_close(chunked.latents, whole.latents, rtol=0, atol=latent_atol)
    # The decoder carries that to the images with its gain, and its own convolutions and
    # group norms round by batch size too (34 ulps of the [0, 1] range seen for 1 vs 6 rows).
    image_atol = _decoder_gain(policy, whole.latents) * latent_atol
    image_atol += chain_atol(torch.float32, 1.0, ulps=128)
    torch.testing.assert_close(chunked.images, whole.images, rtol=0, atol=image_atol)


def _decoder_gain(policy: Policy, latents: torch.Tensor) -> float:
    """max |decode(x + d) - decode(x)| / max |d| for a small random d (about 7 here)."""
    delta = 1e-3 * torch.randn(latents.shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        change = policy.decode(latents + delta) - policy.decode(latents)
    return float(change.abs().max() / delta.abs().max())


def test_rollout_uses_the_adapter_and_leaves_default_trainable(policy: Policy) -> None:
    noise = _noise(policy, 2)
    old = _rollout(policy, 1, 2, noise=noise, adapter="old")
    default = _rollout(policy, 1, 2, noise=noise, adapter="default")
    reference = _rollout(policy, 1, 2, noise=noise, adapter="reference")
    assert not torch.allclose(old.latents, default.latents, atol=1e-4)
    torch.testing.assert_close(default.latents, reference.latents)  # B = 0: default is the base
    assert all(p.requires_grad for p in policy.trainable_parameters())
    assert not old.latents.requires_grad


def test_rollout_rejects_bad_arguments(policy: Policy) -> None:
    for bad in ({"sampler": "ddim"}, {"adapter": "ema"}, {"noise_level": -1.0}, {"batch_size": 0}):
        with pytest.raises(ValueError):
            _rollout(policy, 1, 2, **bad)
    with pytest.raises(ValueError, match="images_per_prompt"):
        _rollout(policy, 0, 2)
    with pytest.raises(ValueError, match="steps"):
        _rollout(policy, 1, 0)
    with pytest.raises(ValueError, match="noise must have shape"):
        _rollout(policy, 1, 2, noise=torch.zeros(3, 4, 8, 8))
    with pytest.raises(ValueError, match="negative_embeds"):
        negative = policy.encode_prompts(["", ""], MAX_TOKENS)
        _rollout(policy, 3, 2, guidance_scale=2.0, negative_embeds=negative)


def test_sde_rollout_records_what_step_objectives_need_in_every_chunk(policy: Policy) -> None:
    """SDE on a window of steps, x_t, x_next and log p_old of it, x0 predictions at every
    step, CFG's unconditional rows: per sample, whatever the chunking."""
    noise = _noise(policy, 6)
    batch = _rollout(
        policy,
        3,
        4,
        noise=noise,
        sampler="sde",
        guidance_scale=3.0,
        sde_steps=[1, 2],
        recorded_steps=[1, 2],
        record_x0=True,
        batch_size=4,
        generator=torch.Generator().manual_seed(3),
    )
    recorded = batch.trajectories
    assert recorded.latents.shape == recorded.next_latents.shape == (6, 2, 4, 8, 8)
    assert recorded.log_probs.shape == (6, 2) and bool(torch.isfinite(recorded.log_probs).all())
    assert recorded.steps.tolist() == [1, 2] and recorded.predicted_x0.shape == (6, 4, 4, 8, 8)
    assert torch.equal(recorded.next_latents[:, 0], recorded.latents[:, 1])
    assert torch.equal(batch.latents, recorded.final)
    assert len(batch.negative) == 6 and len(batch.embeds) == 6

    plain = _rollout(policy, 1, 2, noise=noise[:2])
    assert plain.negative is None and plain.trajectories.predicted_x0 is None
    assert plain.trajectories.latents.shape == (2, 0, 4, 8, 8)
    assert plain.trajectories.log_probs.shape == (2, 0)
    with pytest.raises(ValueError, match="sde_steps need the sde sampler"):
        _rollout(policy, 1, 2, sampler="dpm2", sde_steps=[0])
