"""The gradient-noise probe: its estimators against a known truth, and a run on the trainer."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # benchmarks/ is not installed; `python -m pytest` adds it too
    sys.path.insert(0, str(ROOT))

from benchmarks.mini.gradient_noise import GradientPairs, collect, noise_statistics  # noqa: E402
from mogradient_diffusion.training.distributed import World  # noqa: E402
from mogradient_diffusion.training.trainer import Trainer  # noqa: E402
from mogradient_diffusion.training_config import load_config  # noqa: E402


def _synthetic(mu_norm: float, image_std: float, draw_std: float) -> GradientPairs:
    """g = mu + a + b: a per step (the images, shared by both draws), b per draw."""
    generator = torch.Generator().manual_seed(0)
    dim, epochs, per_epoch = 20_000, 12, 8
    mu = torch.randn(dim, generator=generator, dtype=torch.float64)
    mu *= mu_norm / mu.norm()
    pairs = GradientPairs([], [], [])

    def noise(std: float) -> torch.Tensor:
        return torch.randn(dim, generator=generator, dtype=torch.float64) * std / math.sqrt(dim)

    for epoch in range(epochs):
        for _ in range(per_epoch):
            images = noise(image_std)
            pairs.epochs.append(epoch)
            pairs.first.append(mu + images + noise(draw_std))
            pairs.second.append(mu + images + noise(draw_std))
    return pairs


def test_statistics_recover_a_known_signal_and_noise_split() -> None:
    stats = noise_statistics(_synthetic(mu_norm=0.2, image_std=0.5, draw_std=1.0))
    # Truth: ||mu||^2 = 0.04, noise = 0.25 + 1.0, draw share = 0.8. The estimates' sampling
    # error is ~1/sqrt(dim) of the noise per dot product, averaged over thousands of pairs.
    assert abs(stats["mu2"] - 0.04) < 3 * stats["mu2_standard_error"] + 1e-3
    assert stats["noise"] == pytest.approx(1.25, rel=0.03)
    assert stats["draw_share"] == pytest.approx(0.8, rel=0.03)
    assert stats["step_snr"] == pytest.approx(0.04 / 1.25, rel=0.1)


def test_pure_noise_has_no_signal_within_its_error() -> None:
    stats = noise_statistics(_synthetic(mu_norm=0.0, image_std=0.5, draw_std=1.0))
    assert abs(stats["mu2"]) < 3 * stats["mu2_standard_error"]


def test_collect_measures_the_trainers_steps_without_training(tmp_path: Path) -> None:
    config = load_config(
        preset="tiny",
        overrides=[f"run.directory={tmp_path}", "run.quiet=true", "train.group_batches=true"],
    )
    trainer = Trainer(config, World(rank=0, size=1, device=torch.device("cpu")))
    before = [parameter.detach().clone() for parameter in trainer.parameters]
    pairs = collect(trainer, epochs=2)
    assert set(pairs.epochs) == {0, 1} and len(pairs.first) == len(pairs.second)
    assert all(torch.isfinite(g).all() and g.norm() > 0 for g in pairs.first)
    assert not any(torch.equal(a, b) for a, b in zip(pairs.first, pairs.second, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.parameters, strict=True))
    stats = noise_statistics(pairs)
    assert stats["steps"] == len(pairs.first) and math.isfinite(stats["draw_share"])
