"""How much of an optimizer step's gradient is signal, and where does its noise come from?

A specialist learns when the steps' common direction (the expected gradient mu) adds up
faster than their noise walks the adapter away: Adam moves every step about the learning
rate, so the noise is drift, paid whatever the signal. This measures, at the base model
and with the trainer's own rollouts, advantages and micro-batches, for one reward:

* ``mu2``: ||mu||^2, the mean dot product of gradients from different epochs
  (independent rollouts), with its standard error over epoch pairs;
* ``noise``: E||g - mu||^2 = mean ||g||^2 - mu2, the per-step noise;
* ``draw_share``: the part of that noise the step's noise draws (levels and Gaussian
  noise) make, from a second gradient of the same rows with fresh draws:
  (mean ||g||^2 - mean g.g') / noise. The rest comes from which images were sampled.

Nothing is trained: every step's gradient is computed twice and dropped, so each epoch
samples from the base model.

    python -m benchmarks.mini.gradient_noise --rewards mini_binding --epochs 6
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.mini.learnability import specialist_overrides
from miniature.recipe import BASE_MODEL, CONFIG, write_prompt_files
from mogradient.engines import accumulate_gradients
from mogradient_diffusion.objectives import StepMetrics, TrainPiece
from mogradient_diffusion.training.distributed import World
from mogradient_diffusion.training.records import skipped_step_record
from mogradient_diffusion.training.trainer import Trainer, TrainerCallback, has_signal
from mogradient_diffusion.training_config import load_config

# Named ways to cut and draw a step (config overrides on top of the recipe).
VARIANTS = {
    "per_row": (),
    "group_batches": ("train.group_batches=true",),
    "shared_noise": ("train.group_batches=true", "objective.shared_noise=true"),
}


@dataclass
class GradientPairs:
    """Per optimizer step with signal: its epoch, its gradient, and the same rows' gradient
    with fresh noise draws (flattened, float64)."""

    epochs: list[int]
    first: list[torch.Tensor]
    second: list[torch.Tensor]


class PairCollector(TrainerCallback):
    """Takes every optimizer step's place: the step's gradient under two noise draws."""

    def __init__(self) -> None:
        self.pairs = GradientPairs([], [], [])

    def replace_step(
        self, trainer: Trainer, step: list[TrainPiece], generator: torch.Generator
    ) -> dict[str, Any]:
        count = step[0].advantages.shape[-1]
        if has_signal(torch.cat([piece.advantages for piece in step])).any():
            draws = []
            for _ in range(2):
                losses = trainer.objective.losses(trainer.policy, step, generator, StepMetrics())
                stack = accumulate_gradients(losses, trainer.parameters, count=count)
                draws.append(stack.sum(dim=0).double())
                for parameter in trainer.parameters:  # the KL term went to .grad
                    parameter.grad = None
            self.pairs.epochs.append(trainer.epoch)
            self.pairs.first.append(draws[0])
            self.pairs.second.append(draws[1])
        return skipped_step_record("measured", count)


def collect(trainer: Trainer, epochs: int) -> GradientPairs:
    """Run ``epochs`` epochs of rollouts and advantages, taking no optimizer step."""
    collector = PairCollector()
    trainer.callbacks = (*trainer.callbacks, collector)
    for epoch in range(epochs):
        trainer.epoch = epoch
        trainer.train_epoch()
    return collector.pairs


def noise_statistics(pairs: GradientPairs) -> dict[str, float]:
    """``mu2`` (and its s.e. over epoch pairs), ``noise``, ``draw_share``, ``step_snr``."""
    first = torch.stack(pairs.first)
    epoch = np.asarray(pairs.epochs)
    dots = (first @ first.T).numpy()
    different = epoch[:, None] != epoch[None, :]
    if not different.any():
        raise ValueError("need steps from at least two epochs")
    mu2 = float(dots[different].mean())
    blocks = [
        dots[np.ix_(epoch == a, epoch == b)].mean()
        for a, b in itertools.combinations(np.unique(epoch), 2)
    ]
    squared = float(np.diag(dots).mean())
    repeated = float((first * torch.stack(pairs.second)).sum(dim=1).mean())
    noise = squared - mu2
    return {
        "steps": len(first),
        "mu2": mu2,
        "mu2_standard_error": float(np.std(blocks, ddof=1) / np.sqrt(len(blocks)))
        if len(blocks) > 1
        else float("nan"),
        "mean_squared_norm": squared,
        "noise": noise,
        "draw_share": (squared - repeated) / noise,
        "step_snr": mu2 / noise,
    }


def measure_reward(
    reward: str, variant: str, epochs: int, model: Path = BASE_MODEL, seed: int = 0
) -> dict[str, Any]:
    """The statistics of ``reward``'s specialist recipe (``noise`` = ``mini_noise`` like
    binding: the control, whose mu2 must be 0 within its error) under ``variant``."""
    like = "mini_binding" if reward == "noise" else reward
    with tempfile.TemporaryDirectory() as work:
        overrides = [
            f"model.path={model}",
            f"prompts.directory={write_prompt_files(Path(work) / 'prompts')}",
            f"run.directory={Path(work) / 'run'}",
            f"run.seed={seed}",
            "run.quiet=true",
            *specialist_overrides(like, control=reward == "noise"),
            *VARIANTS[variant],
        ]
        config = load_config(CONFIG, overrides)
        trainer = Trainer(config, World(rank=0, size=1, device=torch.device("cpu")))
        statistics = noise_statistics(collect(trainer, epochs))
    return {"reward": reward, "variant": variant, "epochs": epochs, **statistics}


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| reward | variant | steps | mu2 (s.e.) | noise | step SNR | draw share of noise |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['reward']} | {row['variant']} | {row['steps']} | "
            f"{row['mu2']:.4f} ({row['mu2_standard_error']:.4f}) | {row['noise']:.3f} | "
            f"{row['step_snr']:.4f} | {row['draw_share']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rewards", default="mini_binding,noise")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--model", type=Path, default=BASE_MODEL)
    parser.add_argument("--out", type=Path, default=Path("results/gradient_noise"))
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {sorted(VARIANTS)}")
    if args.epochs < 2:
        parser.error("--epochs must be at least 2 (mu2 compares different epochs)")
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for reward in args.rewards.split(","):
        for variant in variants:
            rows.append(measure_reward(reward, variant, args.epochs, args.model))
            print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    (args.out / "gradient_noise.json").write_text(json.dumps(rows, indent=1))
    (args.out / "gradient_noise.md").write_text(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
