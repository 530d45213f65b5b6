"""SDPO's pieces against independent write-ups: the loss with autograd, dense rewards and the
tracker by plain loops, and the tracker across a kill-and-resume."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tolerances import reduction_atol

from mogradient_diffusion.objectives.sdpo import SDPOSettings, advantage_differences, sdpo_loss
from mogradient_diffusion.objectives.sdpo_advantages import (
    StepAdvantageTracker,
    anchor_similarities,
    dense_rewards,
    discounted_returns,
)

SETTINGS = SDPOSettings()


def _reference_losses(lp_a, lp_b, old_a, old_b, steps, adv_a, adv_b, settings) -> torch.Tensor:
    """The reference loop per reward: mean over applicable (pair, step) entries of
    max((w (rho_a - rho_b) - dA)^2, (w (clip rho_a - clip rho_b) - dA)^2), w = lambda^t / scale,
    rho clipped by clamping log p to old +- eps, advantages clamped before the difference."""
    eps, clip = settings.clip_range, settings.advantage_clip
    weight = settings.step_decay ** steps.double() / settings.log_ratio_scale
    log_diff = (lp_a - old_a) - (lp_b - old_b)
    clipped_a = torch.clamp(lp_a, old_a - eps, old_a + eps) - old_a
    clipped_b = torch.clamp(lp_b, old_b - eps, old_b + eps) - old_b
    losses = []
    for k in range(adv_a.shape[1]):
        valid = ~torch.isnan(adv_a[:, k])
        delta = adv_a[valid, k].clamp(-clip, clip) - adv_b[valid, k].clamp(-clip, clip)
        unclipped = (weight[valid] * log_diff[valid] - delta) ** 2
        clipped = (weight[valid] * (clipped_a - clipped_b)[valid] - delta) ** 2
        losses.append(torch.maximum(unclipped, clipped).mean())
    return torch.stack(losses)


def _problem(seed: int, entries: int = 30, rewards: int = 3):
    """Log-probs of both trajectories through one linear model; on a third of the entries
    rho leaves [-eps, eps] (the clipped branch can win), elsewhere both branches tie."""
    generator = torch.Generator().manual_seed(seed)
    eps = SETTINGS.clip_range

    def draw(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    theta = draw(4).requires_grad_()
    features_a, features_b = draw(entries, 4), draw(entries, 4)
    old_a, old_b = draw(entries), draw(entries)
    outside = torch.arange(entries) % 3 == 0
    sign = torch.where(torch.arange(entries) % 2 == 0, 1.0, -1.0).double()

    def log_probs(old, features, offset_sign):
        inside = (torch.rand(entries, generator=generator, dtype=torch.float64) - 0.5) * eps
        offset = torch.where(outside, offset_sign * 5 * eps, inside)
        return old + offset + 1e-3 * eps * torch.tanh(features @ theta)

    lp_a, lp_b = log_probs(old_a, features_a, sign), log_probs(old_b, features_b, -sign)
    steps = torch.randint(0, 10, (entries,), generator=generator)
    adv_a, adv_b = 2 * draw(entries, rewards), 2 * draw(entries, rewards)
    adv_a[:3, 2] = adv_b[:3, 2] = torch.nan
    adv_a[4, 0] = 8.0  # clamped to 5
    return theta, (lp_a, lp_b, old_a, old_b, steps, adv_a, adv_b), outside


def _loss_inputs(inputs):
    *log_probs_and_steps, adv_a, adv_b = inputs
    return (*log_probs_and_steps, advantage_differences(adv_a, adv_b, SETTINGS.advantage_clip))


@given(seed=st.integers(0, 2**16))
def test_combined_loss_and_gradient_equal_the_reference(seed: int) -> None:
    theta, inputs, outside = _problem(seed)
    lp_a, _, old_a, _ = inputs[:4]
    assert bool(((lp_a - old_a).abs() > SETTINGS.clip_range)[outside].all())
    weights = torch.randn(3, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)

    loss = sdpo_loss(*_loss_inputs(inputs), SETTINGS)
    reference = _reference_losses(*inputs, SETTINGS)
    per_reward = [torch.autograd.grad(reference[k], theta, retain_graph=True)[0] for k in range(3)]
    expected = sum(w * g for w, g in zip(weights, per_reward, strict=True))
    combined = loss.combined(weights)
    (grad,) = torch.autograd.grad(combined, theta)

    torch.testing.assert_close(loss.objective_losses(), reference, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(combined, (weights * reference).sum(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-6)
    scale = sum(g.abs().sum().item() for g in per_reward) * weights.abs().max().item() + 1e-300
    torch.testing.assert_close(
        grad, expected, rtol=0, atol=reduction_atol(torch.float64, 150, scale)
    )


def test_both_branches_are_active_somewhere() -> None:
    """The test problem exercises the clipped branch, the unclipped branch and ties."""
    _, (lp_a, lp_b, old_a, old_b, steps, adv_a, adv_b), _ = _problem(3)
    eps = SETTINGS.clip_range
    weight = SETTINGS.step_decay ** steps.double()
    u = weight * ((lp_a - old_a) - (lp_b - old_b))
    u_clip = weight * ((lp_a - old_a).clamp(-eps, eps) - (lp_b - old_b).clamp(-eps, eps))
    delta = adv_a[:, 0].clamp(-5, 5) - adv_b[:, 0].clamp(-5, 5)
    unclipped, clipped = (u - delta) ** 2, (u_clip - delta) ** 2
    assert (unclipped > clipped).any() and (unclipped < clipped).any()
    assert (unclipped == clipped).sum() >= 10


def test_pieces_of_a_step_add_up() -> None:
    _, inputs, _ = _problem(1)
    inputs = _loss_inputs(inputs)
    whole = sdpo_loss(*inputs, SETTINGS).objective_losses()
    counts = (~torch.isnan(inputs[5])).sum(dim=0)
    parts = [slice(0, 11), slice(11, 30)]
    summed = sum(
        sdpo_loss(*(x[p] for x in inputs), SETTINGS, valid_counts=counts).objective_losses()
        for p in parts
    )
    torch.testing.assert_close(summed, whole, rtol=1e-12, atol=1e-14)


def test_anchor_is_the_interior_step_least_similar_to_both_ends() -> None:
    generator = torch.Generator().manual_seed(0)
    x0 = torch.randn(4, 6, 2, 3, 3, generator=generator, dtype=torch.float64)
    found = anchor_similarities(x0)
    for b in range(4):
        flat = x0[b].reshape(6, -1)

        def cos(i, j, flat=flat):
            return (flat[i] @ flat[j] / (flat[i].norm() * flat[j].norm())).item()

        scores = {t: cos(t, 0) + cos(t, 5) for t in range(1, 5)}
        anchor = min(scores, key=scores.get)
        assert found.anchor[b].item() == anchor
        for t in range(6):
            assert found.first[b, t].item() == pytest.approx(cos(t, 0), rel=1e-12)
            assert found.middle[b, t].item() == pytest.approx(cos(t, anchor), rel=1e-12)
            assert found.last[b, t].item() == pytest.approx(cos(t, 5), rel=1e-12)
    with pytest.raises(ValueError, match="T >= 3"):
        anchor_similarities(x0[:, :2])


def test_dense_rewards_interpolate_and_keep_the_queried_values() -> None:
    generator = torch.Generator().manual_seed(1)
    x0 = torch.randn(3, 5, 2, 2, 2, generator=generator, dtype=torch.float64) + 2
    sims = anchor_similarities(x0)
    first, middle, last = (
        torch.randn(3, 2, generator=generator, dtype=torch.float64) for _ in "fml"
    )
    first[1, 1] = torch.nan
    dense = dense_rewards(first, middle, last, sims)
    for b in range(3):
        a = sims.anchor[b].item()
        for k in range(2):
            for t in range(5):
                if t == 0:
                    expected = first[b, k].item()
                elif t == 4:
                    expected = last[b, k].item()
                elif t == a:
                    expected = middle[b, k].item()
                else:
                    w = [sims.first[b, t].item(), sims.middle[b, t].item(), sims.last[b, t].item()]
                    r = [first[b, k].item(), middle[b, k].item(), last[b, k].item()]
                    expected = sum(x * y for x, y in zip(w, r, strict=True)) / sum(w)
                got = dense[b, t, k].item()
                if (b, k) == (1, 1):  # first is NaN: the reward does not apply here
                    assert math.isnan(got)
                else:
                    assert got == pytest.approx(expected, rel=1e-12)
    assert torch.isnan(dense[1, :, 1]).all()


def test_discounted_returns() -> None:
    rewards = torch.tensor([[[1.0], [2.0], [3.0]]], dtype=torch.float64)
    returns = discounted_returns(rewards, 0.5)
    assert returns.flatten().tolist() == [1 + 0.5 * (2 + 0.5 * 3), 2 + 0.5 * 3, 3.0]
    assert discounted_returns(rewards, 0.0).flatten().tolist() == [1.0, 2.0, 3.0]


class _ListTracker:
    """The reference tracker by plain lists, one reward column."""

    def __init__(self, size: int, min_count: int) -> None:
        self.size, self.min_count, self.buffers = size, min_count, {}

    def update(self, prompts: list[str], returns: list[list[float]]) -> list[list[float]]:
        steps = len(returns[0])
        out = [[0.0] * steps for _ in prompts]
        for prompt in sorted(set(prompts)):
            rows = [i for i, p in enumerate(prompts) if p == prompt]
            for t in range(steps):
                buffer = self.buffers.setdefault((prompt, t), [])
                buffer.extend(returns[i][t] for i in rows)
                del buffer[: max(0, len(buffer) - self.size)]
                pool = buffer if len(buffer) >= self.min_count else [r[t] for r in returns]
                mean = sum(pool) / len(pool)
                std = math.sqrt(sum((x - mean) ** 2 for x in pool) / len(pool)) + 1e-6
                for i in rows:
                    out[i][t] = (returns[i][t] - mean) / std
        return out


def _epochs(count: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    prompts = ["cat", "cat", "dog", "dog", "sun", "sun"]
    return [
        (prompts, torch.randn(6, 4, 2, generator=generator, dtype=torch.float64))
        for _ in range(count)
    ]


def test_tracker_matches_a_plain_reference_and_falls_back_to_batch_statistics() -> None:
    tracker = StepAdvantageTracker(buffer_size=5, min_count=3)
    references = [_ListTracker(5, 3), _ListTracker(5, 3)]
    for prompts, returns in _epochs(4):
        got = tracker.update(prompts, returns)
        for k in range(2):
            expected = references[k].update(prompts, returns[:, :, k].tolist())
            torch.testing.assert_close(
                got[:, :, k], torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12
            )


def test_tracker_skips_nan_returns() -> None:
    tracker = StepAdvantageTracker(buffer_size=4, min_count=1)
    returns = torch.tensor([[[1.0, torch.nan]], [[3.0, torch.nan]]], dtype=torch.float64)
    advantages = tracker.update(["a", "a"], returns)
    assert torch.isnan(advantages[:, :, 1]).all()
    assert advantages[:, 0, 0].tolist() == pytest.approx([-1.0, 1.0], rel=1e-5)
    assert [entry[3] for entry in tracker.state_dict()["buffers"] if entry[0] == 1] == [[]]


def test_tracker_survives_kill_and_resume() -> None:
    """Epochs 1-4 in one process equal epochs 1-2, a checkpoint through JSON, a new
    tracker loading it, epochs 3-4."""
    epochs = _epochs(4, seed=5)
    straight = StepAdvantageTracker(buffer_size=5, min_count=3)
    expected = [straight.update(prompts, returns) for prompts, returns in epochs]

    first = StepAdvantageTracker(buffer_size=5, min_count=3)
    for prompts, returns in epochs[:2]:
        first.update(prompts, returns)
    saved = json.dumps(first.state_dict())
    del first
    resumed = StepAdvantageTracker(buffer_size=5, min_count=3)
    resumed.load_state_dict(json.loads(saved))
    for (prompts, returns), want in zip(epochs[2:], expected[2:], strict=True):
        torch.testing.assert_close(resumed.update(prompts, returns), want, rtol=0, atol=0)
    fresh = StepAdvantageTracker(buffer_size=5, min_count=3).update(*epochs[2])
    assert not torch.allclose(fresh, expected[2])  # the state matters
    with pytest.raises(ValueError, match="buffer_size"):
        StepAdvantageTracker(buffer_size=6, min_count=3).load_state_dict(json.loads(saved))


def test_settings_validation() -> None:
    with pytest.raises(ValueError, match="gamma"):
        SDPOSettings(gamma=1.5)
    with pytest.raises(ValueError, match="clip_range"):
        SDPOSettings(clip_range=0.0)
    with pytest.raises(ValueError, match="min_count"):
        SDPOSettings(buffer_size=8, min_count=16)
    with pytest.raises(ValueError, match="buffer_size"):
        SDPOSettings(buffer_size=0)


def test_loss_input_validation() -> None:
    x = torch.zeros(3)
    steps = torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="differences must be"):
        sdpo_loss(x, x, x, x, steps, torch.zeros(2, 1), SETTINGS)
    with pytest.raises(ValueError, match="steps"):
        sdpo_loss(x, x, x, x, steps[:2], torch.zeros(3, 1), SETTINGS)
    with pytest.raises(ValueError, match="Inf"):
        advantage_differences(torch.full((3, 1), torch.inf), torch.zeros(3, 1), 5.0)
    with pytest.raises(ValueError, match="share a shape"):
        advantage_differences(torch.zeros(3, 1), torch.zeros(2, 1), 5.0)


def test_few_step_evaluation_tabulates_each_step_count(tiny_pipeline_dir, tmp_path) -> None:
    from mogradient_diffusion.evaluation.evaluate import EvalSettings
    from mogradient_diffusion.evaluation.few_step import evaluate_at_steps

    settings = EvalSettings(
        model=str(tiny_pipeline_dir),
        prompts="general",
        metrics=["jpeg_incompressibility"],
        out=str(tmp_path / "base"),
        max_prompts=2,
        images_per_prompt=2,
        batch_size=4,
        max_sequence_length=32,
        device="cpu",
        progress=False,
    )
    out = evaluate_at_steps(settings, steps=(2, 1))
    table = json.loads((out / "few_steps.json").read_text())
    assert list(table["steps"]) == ["1", "2"] and table["label"] == "base"
    means = []
    for count in (1, 2):
        folder = out / f"steps_{count:02d}"
        rows = [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]
        summary = json.loads((folder / "summary.json").read_text())
        assert summary["settings"]["steps"] == count and len(rows) == 4
        entry = table["steps"][str(count)]["jpeg_incompressibility"]
        expected = sum(row["jpeg_incompressibility"] for row in rows) / 4
        assert entry["mean"] == pytest.approx(expected) and entry["n"] == 4
        means.append(entry["mean"])
    assert means[0] != means[1]  # the step count reaches the sampler
    markdown = (out / "few_steps.md").read_text()
    assert "| 1 |" in markdown and "| 2 |" in markdown
    with pytest.raises(ValueError, match="positive integers"):
        evaluate_at_steps(settings, steps=(0,))
