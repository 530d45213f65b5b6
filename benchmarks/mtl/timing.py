"""Time per training step of every method, measured in one interleaved run.

Each method gets its own model (same initialization) and steps on the same batches;
every round runs each method's step once in a rotated order, so load from other jobs
on the shared machine hits all methods alike. Reported as a ratio to equal weighting.
"""

from __future__ import annotations

import statistics

import torch

from benchmarks.common import interleaved_times, timing_summary
from benchmarks.mtl.data import Problem
from benchmarks.mtl.methods import METHODS, applicable, bind, extra_parameters, preference_size
from benchmarks.mtl.model import MultiTaskNet, batch_losses
from benchmarks.mtl.train import seed_everything

REFERENCE = "EW"
WARMUP_ROUNDS = 3


def _stepper(problem: Problem, label: str, batch: int, seed: int):
    seed_everything(seed)
    method = METHODS[label].build(len(problem.tasks), seed)
    model = MultiTaskNet(problem.tasks, preference_size(method, len(problem.tasks)))
    bind(method, model)
    learned = [*model.parameters(), *extra_parameters(method)]
    optimizer = torch.optim.Adam(learned, lr=1e-3)
    generator = torch.Generator().manual_seed(seed)
    after_step = getattr(method, "after_step", None)

    def step() -> None:
        rows = torch.randint(len(problem.train.images), (batch,), generator=generator)
        optimizer.zero_grad()
        # Part of the method's cost: COSMOS's draw, FAMO's second forward.
        preference = method.next_preference() if model.preference_size else None
        features, losses = batch_losses(model, problem.train, rows, preference)
        method.backward(model, losses, features)
        optimizer.step()
        if after_step is not None:
            after_step(lambda: batch_losses(model, problem.train, rows, preference)[1])

    return step


def time_methods(problem: Problem, batch: int, rounds: int, seed: int = 0) -> dict[str, dict]:
    """Median wall/CPU ms per step and the ratio of medians to equal weighting, per method."""
    labels = [label for label, spec in METHODS.items() if applicable(spec, len(problem.tasks))]
    steppers = {label: _stepper(problem, label, batch, seed) for label in labels}
    interleaved_times(steppers, WARMUP_ROUNDS)
    samples = interleaved_times(steppers, rounds)
    reference = statistics.median(samples[REFERENCE]["wall"])
    reference_cpu = statistics.median(samples[REFERENCE]["cpu"])
    summary = {}
    for label in labels:
        stats = timing_summary(samples[label])
        stats["ratio_to_ew"] = statistics.median(samples[label]["wall"]) / reference
        stats["cpu_ratio_to_ew"] = statistics.median(samples[label]["cpu"]) / reference_cpu
        summary[label] = stats
    return summary
