"""Every registered harmonizer on the CAGrad / Nash-MTL 2-D toy, from several starts.

    python -m examples.toy_trajectories --out results/toy_trajectories [--steps 300]

Run it from the repository root: the toy problems live in ``benchmarks/toys``, beside the
demo that runs every harmonizer on them (``make toys``), not in the installed library.

Writes the trajectories in parameter space (over the mean loss, with the exact Pareto
front) and in objective space, and prints where each run ended.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from functools import partial
from pathlib import Path

from benchmarks.toys.demo import SKIPPED
from benchmarks.toys.plots import plot_objective_space, plot_parameter_space
from benchmarks.toys.problems import STANDARD_STARTS, cagrad_toy, optimize_starts
from mogradient import HARMONIZERS, make_harmonizer


def main(argv: Sequence[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/toy_trajectories"))
    parser.add_argument("--steps", type=int, default=300, help="Adam steps per run")
    parser.add_argument("--lr", type=float, default=0.2, help="Adam learning rate")
    parser.add_argument("--starts", type=int, default=5, choices=range(1, 6), help="how many")
    args = parser.parse_args(argv)

    problem = cagrad_toy()
    starts = STANDARD_STARTS[: args.starts]
    runs = {}
    for name in HARMONIZERS:
        if name in SKIPPED:  # 'fixed' is 'mean' up to scale; some methods need K >= 3
            continue
        new_harmonizer = partial(make_harmonizer, name)
        runs[name] = optimize_starts(problem, new_harmonizer, starts, args.steps, args.lr)
        distances = [problem.front_distance(run.final_position) for run in runs[name]]
        print(
            f"{name:<11} distance to the Pareto front: " + "  ".join(f"{d:6.3f}" for d in distances)
        )

    print(plot_parameter_space(problem, runs, args.out / "parameter_space.png"))
    print(plot_objective_space(problem, runs, args.out / "objective_space.png"))
    return args.out


if __name__ == "__main__":
    main()
