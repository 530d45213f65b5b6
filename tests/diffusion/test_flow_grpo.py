"""Flow-GRPO's combinable loss against the reference formula written out with autograd."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tolerances import reduction_atol

from mogradient_diffusion.objectives.flow_grpo import (
    FlowGRPOSettings,
    flow_grpo_advantages,
    flow_grpo_loss,
    kl_to_reference,
)
from mogradient_diffusion.objectives.step_rollout import ratio_metrics

SETTINGS = FlowGRPOSettings()


def _reference_loss(log_probs, old, advantages, eps: float, a_clip: float) -> torch.Tensor:
    """The reference's per-reward loss: mean over applicable entries of
    max(-A r, -A clip(r, 1 - eps, 1 + eps)), A clamped to +-a_clip."""
    ratio = torch.exp(log_probs - old)
    losses = []
    for k in range(advantages.shape[1]):
        valid = ~torch.isnan(advantages[:, k])
        a = advantages[valid, k].clamp(-a_clip, a_clip)
        r = ratio[valid]
        per_entry = torch.maximum(-a * r, -a * torch.clamp(r, 1 - eps, 1 + eps))
        losses.append(per_entry.mean() if valid.any() else r.sum() * 0)
    return torch.stack(losses)


def _problem(seed: int, entries: int = 30, rewards: int = 3):
    """Log-probs through a small linear model (so gradients reach shared parameters), a
    third of the ratios outside [1 - eps, 1 + eps] on either side, signed advantages with
    some beyond the clamp and some NaN."""
    generator = torch.Generator().manual_seed(seed)
    eps = SETTINGS.clip_range
    theta = torch.randn(5, generator=generator, dtype=torch.float64, requires_grad=True)
    features = torch.randn(entries, 5, generator=generator, dtype=torch.float64)
    old = torch.randn(entries, generator=generator, dtype=torch.float64)
    offset = (torch.rand(entries, generator=generator, dtype=torch.float64) - 0.5) * eps
    clipped = torch.arange(entries) % 3 == 0
    sign = torch.where(torch.arange(entries) % 2 == 0, 1.0, -1.0).double()
    offset = torch.where(clipped, sign * 4 * eps, offset)
    drift = 1e-3 * eps * features @ theta  # moves the ratio, not across the clip boundary
    log_probs = old + offset + drift
    advantages = 3 * torch.randn(entries, rewards, generator=generator, dtype=torch.float64)
    advantages[:4, 1] = torch.nan  # reward 1 does not apply to the first entries
    advantages[5, 0] = 9.0  # beyond the clamp
    return theta, log_probs, old, advantages, clipped


@given(seed=st.integers(0, 2**16))
def test_combined_loss_and_gradient_equal_the_reference(seed: int) -> None:
    theta, log_probs, old, advantages, clipped = _problem(seed)
    ratio = torch.exp(log_probs - old).detach()
    assert bool(((ratio - 1).abs() > SETTINGS.clip_range)[clipped].all())
    weights = torch.randn(3, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)

    loss = flow_grpo_loss(log_probs, old, advantages, SETTINGS)
    reference = _reference_loss(log_probs, old, advantages, SETTINGS.clip_range, 5.0)
    per_reward_grads = [
        torch.autograd.grad(reference[k], theta, retain_graph=True)[0] for k in range(3)
    ]
    expected_grad = sum(w * g for w, g in zip(weights, per_reward_grads, strict=True))
    combined = loss.combined(weights)
    (grad,) = torch.autograd.grad(combined, theta)

    torch.testing.assert_close(loss.objective_losses(), reference, rtol=0, atol=1e-12)
    torch.testing.assert_close(combined, (weights * reference).sum(), rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-6)
    scale = sum(g.abs().sum().item() for g in per_reward_grads) * weights.abs().max().item()
    torch.testing.assert_close(
        grad, expected_grad, rtol=0, atol=reduction_atol(torch.float64, 90, scale) + 1e-15
    )


def test_pieces_of_a_step_add_up_to_the_step_loss() -> None:
    _, log_probs, old, advantages, _ = _problem(0)
    whole = flow_grpo_loss(log_probs, old, advantages, SETTINGS).objective_losses()
    counts = (~torch.isnan(advantages)).sum(dim=0)
    halves = [slice(0, 13), slice(13, 30)]
    pieces = sum(
        flow_grpo_loss(
            log_probs[h], old[h], advantages[h], SETTINGS, valid_counts=counts
        ).objective_losses()
        for h in halves
    )
    torch.testing.assert_close(pieces, whole, rtol=0, atol=1e-12)


def test_kl_goes_in_extra_as_beta_times_the_mean_over_the_step() -> None:
    generator = torch.Generator().manual_seed(0)
    mean = torch.randn(4, 2, 3, 3, generator=generator, dtype=torch.float64, requires_grad=True)
    reference = torch.randn(4, 2, 3, 3, generator=generator, dtype=torch.float64)
    scale = torch.tensor([0.9, 0.5, 0.3, 0.2], dtype=torch.float64)
    kl = kl_to_reference(mean, reference, scale)
    expected = torch.stack(
        [((mean[i] - reference[i]) ** 2).mean() / (2 * scale[i] ** 2) for i in range(4)]
    )
    torch.testing.assert_close(kl, expected, rtol=1e-14, atol=0)
    log_probs = torch.zeros(4, dtype=torch.float64)
    advantages = torch.ones(4, 1, dtype=torch.float64)
    loss = flow_grpo_loss(log_probs, log_probs, advantages, SETTINGS, kl=kl, total_entries=8)
    torch.testing.assert_close(loss.extra, SETTINGS.kl_coefficient * kl.sum() / 8)
    with_kl = loss.combined([2.0]) - flow_grpo_loss(
        log_probs, log_probs, advantages, SETTINGS
    ).combined([2.0])
    torch.testing.assert_close(with_kl, loss.extra)


def test_advantages_are_group_centred_over_the_batch_std_and_clamped() -> None:
    rewards = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 1.0], [100.0, torch.nan]])
    groups = torch.tensor([0, 0, 1, 1])
    values, stats = flow_grpo_advantages(rewards, groups, SETTINGS)
    r = rewards.double()
    for k in range(2):
        present = ~torch.isnan(r[:, k])
        std = r[present, k].std(unbiased=False).item() + 1e-4
        for i in range(4):
            if not present[i]:
                assert torch.isnan(values[i, k])
                continue
            mates = [j for j in range(4) if groups[j] == groups[i] and present[j]]
            expected = (r[i, k] - r[mates, k].mean()) / std
            assert values[i, k].item() == pytest.approx(
                max(-5.0, min(5.0, expected.item())), rel=1e-6
            )
    assert "zero_std_group_ratio" in stats


def test_ratio_metrics() -> None:
    old = torch.zeros(4)
    log_probs = torch.log(torch.tensor([1.0, 1.0 + 5e-4, 1.0 - 5e-4, 1.0 + 5e-5]))
    metrics = ratio_metrics(log_probs, old, 1e-4)
    ratio = torch.exp(log_probs.double())
    assert metrics["ratio_mean"] == pytest.approx(ratio.mean().item())
    assert metrics["ratio_std"] == pytest.approx(ratio.std(unbiased=False).item())
    assert metrics["max_abs_ratio_minus_one"] == pytest.approx(5e-4, rel=1e-3)
    assert metrics["clip_fraction_above"] == 0.25 and metrics["clip_fraction_below"] == 0.25
    assert metrics["approx_kl"] == pytest.approx(0.5 * (log_probs.double() ** 2).mean().item())


def test_settings_validation() -> None:
    with pytest.raises(ValueError, match="clip_range"):
        FlowGRPOSettings(clip_range=0)
    with pytest.raises(ValueError, match="kl_coefficient"):
        FlowGRPOSettings(kl_coefficient=-1)
    with pytest.raises(ValueError, match="window_size"):
        FlowGRPOSettings(window_size=6, window_range=(0, 5))
    with pytest.raises(ValueError, match="window_range"):
        FlowGRPOSettings(window_range=(3, 2))
    with pytest.raises(TypeError, match="noise_level"):
        FlowGRPOSettings(noise_level="high")


def test_loss_input_validation() -> None:
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="advantages must be"):
        flow_grpo_loss(x, x, torch.zeros(2, 1), SETTINGS)
    with pytest.raises(ValueError, match="Inf"):
        flow_grpo_loss(x, x, torch.full((3, 1), torch.inf), SETTINGS)
    with pytest.raises(ValueError, match="old_log_probs"):
        flow_grpo_loss(x, torch.zeros(2), torch.zeros(3, 1), SETTINGS)
