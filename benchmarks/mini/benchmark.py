"""The head-to-head in miniature: every method on the same sample budget, scored on held-out
prompts with the training rewards and with metrics no method trained on.

Each (method, seed) is a ``mogradient-diffusion train`` process on the shipped base model
(``miniature/base_model``) with the shared recipe
(``miniature/config.yaml``), then an ``eval``
process on the held-out prompts; processes run ``--workers`` at a time, one thread each.
The aggregate step writes the Table-1 style table, the conflict table (weighted sum vs
MARBLE, measured with ``run.conflict_probe``), training curves, MARBLE's weights, the cost
table and per-method sample grids.

    python -m benchmarks.mini.benchmark --mode full --out benchmarks/results/mini
    python -m benchmarks.mini.benchmark --mode quick --out results/mini_quick
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from benchmarks.mini.report import rising_table, write_report
from benchmarks.mini.runs import Method, RunResult
from benchmarks.mini.solve_scope import write_frontier
from miniature.pretrain import MAX_SEQUENCE_LENGTH
from miniature.recipe import (
    BASE_MODEL,
    CONFIG,
    HELD_OUT,
    TRAIN_REWARDS,
    write_prompt_files,
)
from miniature.world import MiniPrompt, split_prompts

EVAL_STEPS = 16
NOISE = "mini_noise"  # the control's reward: uniform noise, signal-free advantages
# The recipe's changes for the other objectives: their own section (reference defaults),
# the flow SDE for sampling, and rollouts from the trained adapter (ratios start at 1).
OBJECTIVE_OVERRIDES = {
    "flow_grpo": ("objective={name: flow_grpo}", "rollout.sampler=sde", "train.old_schedule=copy"),
    "sdpo": ("objective={name: sdpo}", "rollout.sampler=sde", "train.old_schedule=copy"),
}


@dataclass(frozen=True)
class Budget:
    epochs: int
    seeds: int  # main rows
    ablation_seeds: int
    eval_prompts: int | None  # None: every held-out prompt
    eval_images: int
    # "few": base, the mini_sign specialist, weighted sum, MARBLE; "head_to_head": every
    # baseline and ablation and the cost runs; "objectives": base, weighted sum and MARBLE
    # under each objective.
    rows: Literal["few", "head_to_head", "objectives", "solve_scope"] = "few"


FULL = Budget(
    epochs=30, seeds=3, ablation_seeds=2, eval_prompts=None, eval_images=2, rows="head_to_head"
)
MODES = {
    "test": Budget(epochs=1, seeds=1, ablation_seeds=1, eval_prompts=6, eval_images=1),
    "quick": Budget(epochs=10, seeds=1, ablation_seeds=1, eval_prompts=24, eval_images=1),
    "full": FULL,
    # Its own run (its own --out; the same --work reuses full's NFT rows): Flow-GRPO and
    # SDPO are not part of the head-to-head's budget.
    "objectives": dataclasses.replace(FULL, rows="objectives"),
    # How much of a step a solve must see (benchmarks/mini/solve_scope.py): the variant
    # with 16 micro-steps per optimizer step, 20 epochs (160 optimizer steps)
    "solve_scope": dataclasses.replace(FULL, epochs=20, rows="solve_scope"),
    "solve_scope_quick": Budget(
        epochs=1, seeds=1, ablation_seeds=1, eval_prompts=6, eval_images=1, rows="solve_scope"
    ),
}


def methods(budget: Budget) -> list[Method]:
    """Rows of the head-to-head; quick modes keep base, one specialist, weighted sum, MARBLE."""
    base = Method("base", "base model", trains=False)
    weighted = Method("weighted_sum", "weighted sum", ("strategy.name=weighted_sum",), probe=True)
    marble = Method("marble", "MARBLE (N=10, rho 0.7)", ("strategy.name=marble",), probe=True)
    # Every step solves, so every update is the min-norm point (its cosines come with the
    # solve, no probe); affordable with the per-row gradient engine.
    every_step = Method("marble_every_step", "MARBLE every step (N=1)", ("strategy.period=1",))
    # As released: a solve step solves on its first micro-step (here 1 of its 2; 1 of 192
    # in the SD3.5-M recipe), the rest mixes the advantages by the cached alphas.
    released = Method(
        "marble_released",
        "MARBLE as released (N=10, one micro-step solves)",
        ("strategy.name=marble", "strategy.solve_scope=micro_step"),
        probe=True,
    )
    singles = [
        Method(
            f"single_{r}",
            f"single: {r}",
            ("strategy.name=single", f"strategy.reward={r}", own_prompts_override(r)),
        )
        for r in TRAIN_REWARDS
    ]
    if budget.rows == "few":  # the specialist whose reward rises fastest, for the demo
        return [base, next(m for m in singles if m.key == "single_mini_sign"), weighted, marble]
    if budget.rows == "objectives":
        return [base, weighted, marble, *objective_methods()]
    if budget.rows == "solve_scope":
        return [base, *solve_scope_methods()]
    stage = max(1, budget.epochs // len(TRAIN_REWARDS))
    stages = ", ".join(f"{{rewards: [{r}], epochs: {stage}}}" for r in TRAIN_REWARDS)
    control = Method(
        "noise_control",
        "control: pure-noise reward",
        (f"rewards=[{{name: {NOISE}, options: {{like: mini_preference}}}}]",
         "strategy.name=single", f"strategy.reward={NOISE}"),
    )  # fmt: skip
    baselines = [
        Method(
            "sequential", "sequential", ("strategy.name=sequential", f"strategy.stages=[{stages}]")
        ),
        Method("reward_dropout", "reward dropout (p 0.3)", ("strategy.name=reward_dropout",)),
        Method("pcgrad", "PCGrad", ("strategy.name=pcgrad",)),
        Method("gdpo", "GDPO", ("strategy.name=gdpo",), probe=True),
    ]
    ablation = {"table": "ablations"}
    ablations = [
        Method("marble_no_norm", "MARBLE w/o normalization", ("strategy.normalize=false",),
               **ablation),
        Method("marble_fixed_alpha", "MARBLE fixed equal alpha", ("strategy.fixed_alpha=true",),
               **ablation),
        Method("marble_smoothed", "MARBLE smoothed weights on solve steps",
               ("strategy.smooth_solve_steps=true",), probe=True, **ablation),
    ] + [
        Method(f"marble_rho{rho}", f"MARBLE rho {rho}", (f"strategy.rho={rho}",), **ablation)
        for rho in (0.1, 0.3, 0.5, 0.9)
    ]  # fmt: skip
    return [base, control, *singles, weighted, *baselines, marble, every_step, released, *ablations]


# The variant with many micro-steps per optimizer step (the SD3.5-M recipe has 192): the
# same 8 images a step in 4 micro-batches of 2, each trained at 4 of the 8 sampler levels
# (the recipe: 1 micro-batch of 8 at 2 levels), so 16 micro-steps a step.
MANY_MICRO_STEPS = (
    "train.batch_size=2",
    "train.gradient_accumulation=4",
    "train.timestep_fraction=0.5",
)


def solve_scope_methods() -> list[Method]:
    """How much of the step a MARBLE solve sees, how often, in which space (on the
    variant with 16 micro-steps a step); every row but the exact every-step one probes
    the whole step's conflicts on seed 0."""
    every = "strategy.period=1"
    rows = [
        ("weighted_sum", "weighted sum", ("strategy.name=weighted_sum",)),
        ("step_every", "whole step, every step", (every,)),
        ("step_n10", "whole step, N=10", ()),
        ("released_n10", "one micro-step as released, N=10", ("strategy.solve_scope=micro_step",)),
        ("micro_step_every", "one micro-step (1/16), every step",
         (every, "strategy.solve_fraction=0.0625")),
        ("eighth_every", "1/8 of the step, every step", (every, "strategy.solve_fraction=0.125")),
        ("micro_batch_every", "one micro-batch (1/4), every step",
         (every, "strategy.solve_fraction=0.25")),
        ("outputs_every", "output space, whole step, every step",
         (every, "strategy.solve_space=outputs")),
        ("outputs_micro_step_every", "output space, one micro-step, every step",
         (every, "strategy.solve_space=outputs", "strategy.solve_fraction=0.0625")),
        ("stale_n10", "whole step when stale in output space, N=10",
         ("strategy.solve_when_stale=true",)),
    ]  # fmt: skip
    control = Method(
        "noise_control",
        "control: pure-noise reward",
        (f"rewards=[{{name: {NOISE}, options: {{like: mini_preference}}}}]",
         "strategy.name=single", f"strategy.reward={NOISE}", *MANY_MICRO_STEPS),
    )  # fmt: skip
    return [control] + [
        Method(key, label, (*overrides, *MANY_MICRO_STEPS), probe=key != "step_every")
        for key, label, overrides in rows
    ]


def objective_methods() -> list[Method]:
    """Weighted sum and MARBLE trained with Flow-GRPO and SDPO instead of DiffusionNFT."""
    return [
        Method(f"{objective}_{strategy}", f"{label}, {strategy_label}",
               (*OBJECTIVE_OVERRIDES[objective], f"strategy.name={strategy}"), table="objectives")
        for objective, label in (("flow_grpo", "Flow-GRPO"), ("sdpo", "SDPO"))
        for strategy, strategy_label in (("weighted_sum", "weighted sum"), ("marble", "MARBLE"))
    ]  # fmt: skip


COST_EPOCHS = 10  # 80 optimizer steps: step times settle long before


def cost_methods() -> list[Method]:
    """Side-by-side timing runs (no probe): the ratios of the paper's cost table."""
    epochs = f"train.epochs={COST_EPOCHS}"  # after the budget's epochs, so it wins
    return [
        Method("cost_weighted_sum", "weighted sum", ("strategy.name=weighted_sum", epochs)),
        Method("cost_marble", "MARBLE amortized (N=10)", ("strategy.name=marble", epochs)),
        Method("cost_marble_every_step", "MARBLE every step (N=1)", ("strategy.period=1", epochs)),
        Method(
            "cost_marble_released",
            "MARBLE as released (N=10)",
            ("strategy.solve_scope=micro_step", epochs),
        ),
        Method("cost_gdpo", "GDPO", ("strategy.name=gdpo", epochs)),
    ]


def scored_by(reward: str, prompts: list[MiniPrompt]) -> list[MiniPrompt]:
    """The ``prompts`` that ``reward`` scores (it returns NaN on the others)."""
    import torch

    import miniature  # noqa: F401  (registers the mini rewards)
    from mogradient_diffusion.rewards.registry import make_reward

    blank = torch.zeros(len(prompts), 3, 8, 8)
    scores = make_reward(reward)(blank, [p.text for p in prompts], [p.metadata for p in prompts])
    return [p for p, s in zip(prompts, scores.tolist(), strict=True) if not math.isnan(s)]


@functools.cache
def sources_scored_by(reward: str) -> tuple[str, ...]:
    """The training prompt sources ``reward`` scores (cached: ``methods`` asks on every call,
    and each answer builds the reward)."""
    train, _ = split_prompts(seed=0)
    return tuple(source for source, prompts in train.items() if scored_by(reward, prompts))


def own_prompts_override(reward: str) -> str:
    """A specialist trains on the prompts its reward scores, as single-reward baselines train
    on their reward's own prompt set: on the others its advantages are NaN, so those images
    would cost a rollout and teach nothing."""
    sources = ", ".join(
        f"{{name: {source}, file: {source}.jsonl}}" for source in sources_scored_by(reward)
    )
    return f"prompts.sources=[{sources}]"


def _child(command: list[str], log: Path) -> tuple[float, float]:
    """Run a CLI process with one thread; returns (seconds, peak RSS MiB); raises on failure."""
    env = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    started = time.perf_counter()
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        tail = log.read_text().splitlines()[-15:]
        raise RuntimeError(f"{' '.join(command[:5])} failed; see {log}:\n" + "\n".join(tail))
    return seconds, usage.ru_maxrss / 1024


def run_one(
    method: Method, seed: int, budget: Budget, work: Path, prompts: Path, model: Path
) -> RunResult:
    """Train (unless the base row) then evaluate one (method, seed).

    Work already finished in ``work`` is kept: an evaluated run is not redone, a trained
    run is only evaluated, and a killed training run resumes from its last checkpoint.
    """
    name = f"{method.key}/s{seed}"
    run_dir = work / "runs" / name if method.trains else None
    result = RunResult(method, seed, run_dir, work / "evals" / name)
    if (result.eval_dir / "summary.json").is_file():
        return _with_process_record(result)
    cli = [sys.executable, "-m", "mogradient_diffusion.cli"]
    if run_dir is not None and (run_dir / "lora").is_dir():
        result = _with_process_record(result)
    elif run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        command = [
            *cli, "train", "--config", str(CONFIG),
            f"model.path={model}", f"prompts.directory={prompts}",
            f"run.directory={run_dir}", f"run.seed={seed}", f"train.epochs={budget.epochs}",
            f"run.conflict_probe={str(method.probe and seed == 0).lower()}",
            *method.overrides,
        ]  # fmt: skip
        result.train_seconds, result.peak_rss_mib = _child(command, run_dir / "train.log")
        process = {"seconds": result.train_seconds, "peak_rss_mib": result.peak_rss_mib}
        (run_dir / "process.json").write_text(json.dumps(process))
    result.eval_dir.mkdir(parents=True, exist_ok=True)
    command = [
        *cli, "eval", "--model", str(model), "--prompts", str(prompts / "heldout.jsonl"),
        "--metrics", ",".join(TRAIN_REWARDS + HELD_OUT),
        "--reward-module", "miniature",
        "--out", str(result.eval_dir), "--steps", str(EVAL_STEPS), "--seed", "1000",
        "--images-per-prompt", str(budget.eval_images), "--batch-size", "16", "--device", "cpu",
        "--max-sequence-length", str(MAX_SEQUENCE_LENGTH),
        "--label", method.label, "--quiet",
    ]  # fmt: skip
    if budget.eval_prompts is not None:
        command += ["--max-prompts", str(budget.eval_prompts)]
    if run_dir is not None:
        command += ["--lora", str(run_dir / "lora")]
    _child(command, result.eval_dir.parent / f"{result.eval_dir.name}.log")
    return result


def jobs_of(budget: Budget) -> list[tuple[Method, int]]:
    """Every (method, seed) of a budget: main rows on ``seeds`` seeds, ablations on
    ``ablation_seeds``, the (deterministic) base row once."""
    jobs = [
        (method, seed)
        for method in methods(budget)
        for seed in range(
            1 if not method.trains else budget.ablation_seeds if method.ablation else budget.seeds
        )
    ]
    return jobs + [(m, 0) for m in cost_methods()] if budget.rows == "head_to_head" else jobs


def collect_results(mode: str, work: Path) -> list[RunResult]:
    """The finished runs of ``mode`` found in ``work`` (to rebuild or salvage a report)."""
    results = []
    for method, seed in jobs_of(MODES[mode]):
        name = f"{method.key}/s{seed}"
        run_dir = work / "runs" / name if method.trains else None
        result = RunResult(method, seed, run_dir, work / "evals" / name)
        if (result.eval_dir / "summary.json").is_file():
            results.append(_with_process_record(result))
    return results


def _with_process_record(result: RunResult) -> RunResult:
    """``result`` with the training time and memory its finished run recorded."""
    record = None if result.run_dir is None else result.run_dir / "process.json"
    if record is not None and record.is_file():
        process = json.loads(record.read_text())
        result.train_seconds, result.peak_rss_mib = process["seconds"], process["peak_rss_mib"]
    return result


def run_benchmark(
    mode: str,
    out: Path,
    work: Path,
    workers: int,
    model: Path = BASE_MODEL,
    only: tuple[str, ...] = (),
) -> Path:
    """Every run of ``mode`` (or of its methods ``only``), then the tables and plots in
    ``out``; returns ``out``."""
    budget = MODES[mode]
    if not (model / "model_index.json").is_file():
        raise FileNotFoundError(
            f"no base model at {model}: run `python -m miniature.pretrain --out {model}`"
        )
    prompts = write_prompt_files(work / "prompts")
    jobs = jobs_of(budget)
    if only:
        unknown = sorted(set(only) - {method.key for method, _ in jobs})
        if unknown:
            raise ValueError(f"--only names no method of mode {mode!r}: {', '.join(unknown)}")
        jobs = [(method, seed) for method, seed in jobs if method.key in only]
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(run_one, m, s, budget, work, prompts, model) for m, s in jobs]
        results = []
        for done, future in enumerate(futures, start=1):
            results.append(future.result())
            print(
                f"[{done}/{len(jobs)}] {results[-1].method.label} seed {results[-1].seed}",
                flush=True,
            )
    out.mkdir(parents=True, exist_ok=True)
    report = write_report(results, out, mode, time.perf_counter() - started, workers)
    if budget.rows == "solve_scope":
        write_frontier(results, out)
    if report["rising"]:
        print("\n".join(rising_table(report["rising"], list(TRAIN_REWARDS))))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=sorted(MODES), default="quick")
    parser.add_argument("--out", type=Path, default=Path("results/mini_quick"))
    parser.add_argument("--work", type=Path, help="runs and evals (default: <out>/work)")
    parser.add_argument("--workers", type=int, default=2, help="processes at a time")
    parser.add_argument("--model", type=Path, default=BASE_MODEL)
    parser.add_argument(
        "--report-only", action="store_true", help="rebuild the report from the finished runs"
    )
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated method keys: run and report only these rows of --mode",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the finished runs in --work and do only what is missing",
    )
    args = parser.parse_args(argv)
    work = args.work or args.out / "work"
    if args.report_only:
        args.out.mkdir(parents=True, exist_ok=True)
        results = collect_results(args.mode, work)
        write_report(results, args.out, args.mode, math.nan, args.workers)
        if MODES[args.mode].rows == "solve_scope":
            write_frontier(results, args.out)
        print(f"report rebuilt from {work}: {args.out / 'table.md'}")
        return 0
    if work.exists() and not args.resume:
        shutil.rmtree(work)
    try:
        only = tuple(key for key in args.only.split(",") if key)
        out = run_benchmark(args.mode, args.out, work, args.workers, args.model, only)
    except (FileNotFoundError, RuntimeError, ValueError) as error:
        print(f"mini benchmark: {error}", file=sys.stderr)
        return 2
    print(f"results: {out / 'table.md'}, {out / 'conflict.md'}, plots in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
