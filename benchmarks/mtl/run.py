"""The multi-task head-to-head: mogradient vs TorchJD vs LibMTL on scikit-learn's digits.

    python -m benchmarks.mtl.run            # full: 5 seeds, ~50 min on 2 cores
    python -m benchmarks.mtl.run --quick    # every method once, tiny budget, < 2 min

Writes table.md, results.json, comparison.md and PNG plots to --out
(default benchmarks/results/mtl). Runs go to --workers processes of one thread each;
step times are measured afterwards in one interleaved single-process run.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.common import machine_info
from benchmarks.mtl import compare, compare_losses, plots, report
from benchmarks.mtl.data import PROBLEMS, Problem
from benchmarks.mtl.methods import METHODS, applicable, preference_method
from benchmarks.mtl.metrics import (
    best_multi_task_epoch,
    best_single_task_epoch,
    delta_m,
    mean_std,
)
from benchmarks.mtl.timing import time_methods
from benchmarks.mtl.train import Budget, train

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "mtl"
SWEEP_PROBLEM = "multi-digits"
SWEEP_KINDS = ("MGDA-NR", "weighted sum")


@dataclass(frozen=True)
class Settings:
    sizes: tuple[int, int, int]  # train, validation, test examples per problem
    budget: Budget
    seeds: tuple[int, ...]
    sweep_seeds: tuple[int, ...]
    sweep_shares: tuple[float, ...]  # preference on the first task; the second gets 1 - share
    timing_rounds: int
    compare_steps: int | None  # EW steps before the later compared stacks; None: toy stack only


FULL = Settings(
    sizes=(3200, 1000, 2000),
    budget=Budget(epochs=6, batch=128, learning_rate=3e-3, diagnostics_every=5),
    seeds=(0, 1, 2, 3, 4),
    sweep_seeds=(0, 1),
    sweep_shares=(0.1, 0.3, 0.5, 0.7, 0.9),
    timing_rounds=40,
    compare_steps=200,
)
QUICK = Settings(
    sizes=(256, 128, 128),
    budget=Budget(epochs=2, batch=64, learning_rate=3e-3, diagnostics_every=2),
    seeds=(0,),
    sweep_seeds=(0,),
    sweep_shares=(0.2, 0.8),
    timing_rounds=1,
    compare_steps=None,
)


@functools.cache
def load_problem(name: str, sizes: tuple[int, int, int]) -> Problem:
    return PROBLEMS[name](sizes)


def run_job(job: dict) -> dict:
    """One training run in a worker process; returns its record plus the job's identity."""
    torch.set_num_threads(1)
    problem = load_problem(job["problem"], tuple(job["sizes"]))
    budget = Budget(**job["budget"])
    start = time.perf_counter()
    if job["kind"] == "single":
        record = train(problem, None, job["seed"], budget, [job["task"]])
    elif job["kind"] == "method":
        method = METHODS[job["label"]].build(len(problem.tasks), job["seed"])
        record = train(problem, method, job["seed"], budget)
    else:
        method = preference_method(job["label"], tuple(job["preference"]))
        record = train(problem, method, job["seed"], budget)
    record["seconds"] = time.perf_counter() - start
    library = METHODS[job["label"]].library if job["kind"] == "method" else "mogradient"
    return {**job, **record, "library": library}


def make_jobs(settings: Settings) -> list[dict]:
    common = {"sizes": list(settings.sizes), "budget": asdict(settings.budget)}
    jobs = []
    for name in PROBLEMS:
        num_tasks = len(load_problem(name, settings.sizes).tasks)
        for seed in settings.seeds:
            for label, spec in METHODS.items():
                if applicable(spec, num_tasks):
                    jobs.append({**common, "problem": name, "kind": "method", "label": label,
                                 "seed": seed})  # fmt: skip
            for task in range(num_tasks):
                jobs.append({**common, "problem": name, "kind": "single", "task": task,
                             "label": "single-task", "seed": seed})  # fmt: skip
    for seed in settings.sweep_seeds:
        for kind in SWEEP_KINDS:
            for share in settings.sweep_shares:
                jobs.append({**common, "problem": SWEEP_PROBLEM, "kind": "sweep", "label": kind,
                             "preference": [share, 1.0 - share], "seed": seed})  # fmt: skip
    return jobs


def run_all(jobs: list[dict], workers: int, log: Path | None = None) -> list[dict]:
    if workers <= 1:
        return [run_job(job) for job in jobs]
    context = multiprocessing.get_context("spawn")
    records = []
    with context.Pool(workers) as pool:
        for record in pool.imap_unordered(run_job, jobs, chunksize=1):
            records.append(record)
            if log is not None:  # a crash after hours of training must not lose the runs
                with log.open("a") as handle:
                    handle.write(json.dumps(record) + "\n")
            print(f"{len(records)}/{len(jobs)} runs done", file=sys.stderr, flush=True)
    return records


def summarize(problem: Problem, records: list[dict]) -> dict:
    """Single-task baselines, then every method's selected-epoch test metrics and Δm%."""
    tasks = problem.tasks
    singles = [r for r in records if r["kind"] == "single"]
    baseline_test, baseline_validation, single_seeds = [], [], {}
    for index, task in enumerate(tasks):
        chosen = []
        for run in (r for r in singles if r["task"] == index):
            epoch = best_single_task_epoch(task, [row[0] for row in run["validation"]])
            chosen.append((run["seed"], run["validation"][epoch][0], run["test"][epoch][0]))
            single_seeds.setdefault(run["seed"], {})[index] = run["test"][epoch][0]
        baseline_validation.append(mean_std([value for _, value, _ in chosen])[0])
        baseline_test.append(mean_std([value for _, _, value in chosen])[0])
    summary = {
        "tasks": [asdict(task) for task in tasks],
        "baseline_test": baseline_test,
        "baseline_validation": baseline_validation,
        "methods": {},
        "sweeps": {},
    }
    single_rows = [[values[k] for k in range(len(tasks))] for values in single_seeds.values()]
    summary["methods"]["single-task"] = _method_summary(
        "baseline", tasks, single_rows, [None] * len(single_rows), baseline_test, singles
    )
    groups: dict[tuple, list[dict]] = {}
    for run in records:
        if run["kind"] != "single":
            key = (run["kind"], run["label"], tuple(run.get("preference", ())))
            groups.setdefault(key, []).append(run)
    for (kind, label, preference), runs in groups.items():
        runs.sort(key=lambda run: run["seed"])
        epochs = [
            best_multi_task_epoch(tasks, run["validation"], baseline_validation) for run in runs
        ]
        rows = [run["test"][epoch] for run, epoch in zip(runs, epochs, strict=True)]
        library = METHODS[label].library if kind == "method" else "mogradient"
        entry = _method_summary(library, tasks, rows, epochs, baseline_test, runs)
        if kind == "method":
            summary["methods"][label] = entry
        else:
            entry["preference"] = list(preference)
            summary["sweeps"].setdefault(label, []).append(entry)
    return summary


def _method_summary(library, tasks, rows, epochs, baseline, runs) -> dict:
    deltas = [delta_m(tasks, row, baseline) for row in rows]
    cosines = [value for run in runs for value in run["cos_min"] if value == value]
    return {
        "library": library,
        "seeds": [run["seed"] for run in runs] if library != "baseline" else len(rows),
        "test": [mean_std([row[k] for row in rows]) for k in range(len(tasks))],
        "delta_m": mean_std(deltas),
        "delta_m_per_seed": deltas,
        "selected_epochs": epochs,
        "mean_cos_min": mean_std(cosines)[0] if cosines else None,
        "negative_cos_min_share": (
            sum(value < 0 for value in cosines) / len(cosines) if cosines else None
        ),
        "seconds_per_run": mean_std([run["seconds"] for run in runs])[0],
    }


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny budget, one seed (< 2 min)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--workers", type=int, help="processes (default: 2, or 1 with --quick); runs are seeded"
    )
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    workers = args.workers or (1 if args.quick else min(2, os.cpu_count() or 1))
    torch.set_num_threads(1)
    load_start = os.getloadavg()
    started = time.perf_counter()

    args.out.mkdir(parents=True, exist_ok=True)
    log = None if args.quick else Path(os.environ.get("MTL_RUN_LOG", "/tmp/mtl_runs.jsonl"))
    records = run_all(make_jobs(settings), workers, log)
    training_seconds = time.perf_counter() - started
    results = {"mode": "quick" if args.quick else "full", "settings": asdict(settings)}
    results["problems"] = {}
    for name in PROBLEMS:
        problem = load_problem(name, settings.sizes)
        mine = [record for record in records if record["problem"] == name]
        results["problems"][name] = summarize(problem, mine)
        results["problems"][name]["timing"] = time_methods(
            problem, settings.budget.batch, settings.timing_rounds
        )
    results["comparison"] = compare.compare_all(seed=0, trained_steps=settings.compare_steps)
    results["comparison_losses"] = compare_losses.compare_losses(seed=0)
    results["training_seconds"] = training_seconds
    results["total_seconds"] = time.perf_counter() - started
    results["workers"] = workers
    results["machine"] = {**machine_info(), "loadavg_1_5_15_start": load_start}
    results["machine"]["versions"].update(compare.library_versions())

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1, default=float) + "\n")
    (args.out / "table.md").write_text(report.table_markdown(results))
    comparison = compare.comparison_markdown(results["comparison"], results["comparison_losses"])
    (args.out / "comparison.md").write_text(comparison)
    plots.write_all(results, records, args.out)
    print(report.table_markdown(results))
    print(f"total {results['total_seconds']:.0f} s; wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
