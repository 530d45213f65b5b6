"""What harmonizing costs against the weighted sum, with each gradient engine.

Why: MARBLE's update is conflict-free only on steps that solve, and a solve needs the K
per-reward gradients. The K-backward engine (one vmapped backward with K cotangents)
made solving every step cost half the throughput; the per-row engine
(``train.gradient_engine=auto``) needs one backward pass per row value of the losses
(NFT 2, Flow-GRPO and SDPO 1). This runs the real trainer side by side on the
miniature's recipe (K = 5 rewards, ``mini/config.yaml``, shipped base model) and on the
tiny preset, one thread per process, rows interleaved over rounds in rotated order, and
reads ``time/*`` from each run's ``metrics.jsonl`` (the first epoch is left out: start-up
and the engine's one-time check):

* train s/epoch: ``time/train`` (every optimizer step: forwards, backwards, solve, Adam);
* epoch s: ``time/rollout + time/reward + time/train``;
* probe s/epoch: ``time/probe`` of a weighted-sum run with ``run.conflict_probe`` (the
  K per-reward gradients of every step, measured apart from the step);
* peak RSS: the training process's high-water mark (``ru_maxrss``).

Throughput ratios are the weighted sum's seconds over the row's (same recipe and
objective), each row's fastest round: on a shared machine the round least interrupted
by other jobs (the medians are in the JSON too).

Run: ``python benchmarks/bench_engine_cost.py [--rounds 2] [--epochs 7] [--quick]``;
``--quick`` (one round of 2 epochs: the mini recipe's NFT weighted sum and every-step
MARBLE with each engine; its processes two at a time, so its times are not a result)
prints its table and writes nothing unless ``--out`` is given.

``--solve-scope`` times the settings of the solve-scope frontier instead (its ``--quick``:
one epoch each of the weighted sum and a one-micro-step solve)
(``benchmarks/mini/solve_scope.py``: how much of the step a MARBLE solve sees, how often,
in which space) on its variant with 16 micro-steps per optimizer step, and writes
``solve_scope_cost``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import machine_info, machine_markdown, markdown_table, publish

from mogradient_diffusion.runs import metric_keys as keys

NAME = "engine_cost"
ROOT = Path(__file__).resolve().parents[1]
MINI = ROOT / "miniature"
TINY_REWARDS = ("color_match", "jpeg_incompressibility", "count_match", "ocr")
OBJECTIVES = {
    "nft": (),
    "flow_grpo": ("objective={name: flow_grpo}", "rollout.sampler=sde", "train.old_schedule=copy"),
    "sdpo": ("objective={name: sdpo}", "rollout.sampler=sde", "train.old_schedule=copy"),
}
STRATEGIES = {
    "weighted_sum": ("strategy.name=weighted_sum", "strategy.period=null", "strategy.rho=null"),
    "marble_n10": ("strategy.name=marble", "strategy.period=10", "strategy.rho=0.7"),
    "marble_every_step": ("strategy.name=marble", "strategy.period=1", "strategy.rho=0.7"),
}
# The paper's figures and this project's targets (issue: the per-row engine).
TARGETS = {
    ("nft", "marble_every_step"): {"train": 0.75, "epoch": 0.88, "paper": 0.56},
    ("nft", "marble_n10"): {"train": 0.97, "paper": 0.97},
    ("flow_grpo", "marble_every_step"): {"train": 0.95},
    ("sdpo", "marble_every_step"): {"train": 0.95},
}
MEMORY_TARGET = 1.10


@dataclass(frozen=True)
class Row:
    recipe: str  # mini | tiny | mini_many (the solve-scope variant: 16 micro-steps a step)
    objective: str
    strategy: str
    engine: str  # auto (per-row where possible) | batched (K backward passes)
    probe: bool = False

    @property
    def key(self) -> str:
        probe = "_probe" if self.probe else ""
        return f"{self.recipe}_{self.objective}_{self.strategy}_{self.engine}{probe}"


def rows_for(quick: bool) -> list[Row]:
    """Every timed configuration: the weighted sum once, harmonized rows per engine."""
    rows = []
    objectives = ("nft",) if quick else tuple(OBJECTIVES)
    for recipe in ("mini",) if quick else ("mini", "tiny"):
        for objective in objectives if recipe == "mini" else ("nft",):
            rows.append(Row(recipe, objective, "weighted_sum", "auto"))
            strategies = ("marble_every_step",) if objective != "nft" or quick else STRATEGIES
            for strategy in strategies:
                if strategy == "weighted_sum":
                    continue
                rows += [Row(recipe, objective, strategy, e) for e in ("auto", "batched")]
            if objective == "nft" and not quick:
                rows += [
                    Row(recipe, objective, "weighted_sum", e, True) for e in ("auto", "batched")
                ]
    return rows


def scope_overrides() -> dict[str, tuple[str, ...]]:
    """The solve-scope frontier's settings (its rows' overrides, the variant's included)."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.mini.benchmark import solve_scope_methods

    return {m.key: m.overrides for m in solve_scope_methods() if m.key != "noise_control"}


def scope_rows(quick: bool) -> list[Row]:
    keys = ("weighted_sum", "micro_step_every") if quick else tuple(scope_overrides())
    return [Row("mini_many", "nft", key, "auto") for key in keys]


def command_for(row: Row, run_dir: Path, epochs: int, prompts: Path) -> list[str]:
    cli = [sys.executable, "-m", "mogradient_diffusion.cli", "train"]
    common = [
        f"run.directory={run_dir}",
        "run.quiet=true",
        f"run.checkpoint_every={epochs + 1}",  # no checkpoint writes: not what is timed
        f"train.epochs={epochs}",
        f"train.gradient_engine={row.engine}",
        f"run.conflict_probe={str(row.probe).lower()}",
        *OBJECTIVES[row.objective],
        *(scope_overrides() if row.recipe == "mini_many" else STRATEGIES)[row.strategy],
    ]
    if row.recipe in ("mini", "mini_many"):
        base = ["--config", str(MINI / "config.yaml"), f"model.path={MINI / 'base_model'}"]
        return [*cli, *base, f"prompts.directory={prompts}", *common]
    rewards = "rewards=[" + ", ".join(f"{{name: {name}}}" for name in TINY_REWARDS) + "]"
    return [*cli, "--preset", "tiny", rewards, "train.batch_size=2", *common]


def run_once(row: Row, epochs: int, workdir: Path, tag: str, prompts: Path) -> dict[str, Any]:
    """One training process (one thread); per-epoch times after the first, peak RSS."""
    run_dir = workdir / tag
    env = os.environ | {
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TQDM_DISABLE": "1",
    }
    log = workdir / f"{tag}.log"
    with log.open("w") as out:
        command = command_for(row, run_dir, epochs, prompts)
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(process.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{tag} failed:\n{log.read_text()[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = records[1:] if len(records) > 1 else records
    steps = [step for record in timed for step in record[keys.OPTIMIZER_STEPS]]
    return {
        "train_s": statistics.mean(r[keys.TRAIN_TIME] for r in timed),
        "epoch_s": statistics.mean(
            r[keys.ROLLOUT_TIME] + r[keys.REWARD_TIME] + r[keys.TRAIN_TIME] for r in timed
        ),
        "probe_s": statistics.mean(r.get(keys.PROBE_TIME, 0.0) for r in timed),
        "backward_s": statistics.mean(r[keys.BACKWARD_TIME] for r in timed),
        "solved": sum(int(step[keys.SOLVED]) for step in steps),
        "steps": len(steps),
        "skipped": sum(1 for step in steps if keys.SKIPPED in step),
        "engines": sorted({step["engine"] for step in steps if "engine" in step}),
        "peak_rss_mib": usage.ru_maxrss / 1024,
    }


def summarize(runs: dict[str, list[dict[str, Any]]], rows: list[Row]) -> list[dict[str, Any]]:
    """Per row: fastest round (peak RSS: largest) and ratios against its weighted sum."""
    fields = ("train_s", "epoch_s", "probe_s", "backward_s")
    fastest = {
        key: {field: min(run[field] for run in items) for field in fields}
        | {"peak_rss_mib": max(run["peak_rss_mib"] for run in items)}
        for key, items in runs.items()
    }
    medians = {
        key: {field: statistics.median(run[field] for run in items) for field in fields}
        for key, items in runs.items()
    }
    table = []
    for row in rows:
        base = fastest[Row(row.recipe, row.objective, "weighted_sum", "auto").key]
        mine = fastest[row.key]
        last = runs[row.key][-1]
        table.append(
            {
                "row": row.__dict__ | {"key": row.key},
                **mine,
                "train_throughput": base["train_s"] / mine["train_s"],
                "epoch_throughput": base["epoch_s"] / mine["epoch_s"],
                "memory_ratio": mine["peak_rss_mib"] / base["peak_rss_mib"],
                "median": medians[row.key],
                "solved": last["solved"],
                "steps": last["steps"],
                "skipped": last["skipped"],
                "engines": last["engines"],
                "rounds": [
                    {"train_s": r["train_s"], "epoch_s": r["epoch_s"]} for r in runs[row.key]
                ],
            }
        )
    return table


def render_markdown(payload: dict[str, Any]) -> str:
    config = payload["config"]
    lines = [
        "# Harmonization cost by gradient engine (CPU, one thread per run)",
        "",
        machine_markdown(payload["machine"]),
        "",
        f"{config['rounds']} interleaved round(s) of {config['epochs']} epochs per row; the "
        "first epoch of each run is left out; each row's fastest round. Ratios: the "
        "weighted sum's seconds over the row's (throughput, higher is better) and the "
        "row's peak RSS over the weighted sum's. `engine`: `rows` = per-row engine, "
        "`batched` = K backward passes (for a probe row: the probe's). "
        "Mini: K = 5 rewards, 8 optimizer steps of 8 images per epoch; tiny: K = "
        f"{len(TINY_REWARDS)} ({', '.join(TINY_REWARDS)}), 4 steps of 2 images; mini_many: "
        "the mini recipe's 8 images a step in 4 micro-batches of 2 at 4 of the 8 levels "
        "(16 micro-steps a step), strategy = the solve-scope frontier's setting.",
        "",
    ]
    header = [
        "recipe",
        "objective",
        "strategy",
        "engine",
        "train s/epoch",
        "train throughput",
        "epoch s",
        "epoch throughput",
        "probe s/epoch",
        "peak RSS MiB",
        "memory",
        "solved/steps",
        "target (train / epoch)",
    ]
    body = []
    for entry in payload["rows"]:
        row = entry["row"]
        target = (
            TARGETS.get((row["objective"], row["strategy"])) if row["recipe"] == "mini" else None
        )
        engine = "/".join(entry["engines"]) or "-"
        if row["probe"]:
            engine = {"auto": "rows", "batched": "batched"}[row["engine"]]
        wanted = "-"
        if target is not None and engine == "rows" and not row["probe"]:
            wanted = f">= {target['train']:.2f}" + (
                f" / >= {target['epoch']:.2f}" if "epoch" in target else ""
            )
        body.append(
            [
                row["recipe"],
                row["objective"],
                row["strategy"] + (" + probe" if row["probe"] else ""),
                engine,
                f"{entry['train_s']:.3f}",
                f"{entry['train_throughput']:.2f}x",
                f"{entry['epoch_s']:.3f}",
                f"{entry['epoch_throughput']:.2f}x",
                f"{entry['probe_s']:.3f}" if row["probe"] else "-",
                f"{entry['peak_rss_mib']:.0f}",
                f"{entry['memory_ratio']:.2f}x",
                f"{entry['solved']}/{entry['steps']}",
                wanted,
            ]
        )
    lines += [markdown_table(header, body), ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 round, 2 epochs")
    parser.add_argument("--out", type=Path, help="results folder (default: benchmarks/results)")
    parser.add_argument(
        "--solve-scope", action="store_true", help="time the solve-scope frontier's settings"
    )
    args = parser.parse_args()
    rounds, epochs = (1, 2) if args.quick else (args.rounds, args.epochs)
    if args.quick and args.solve_scope:  # one epoch of 16 micro-steps a step is enough to smoke
        epochs = 1
    rows = scope_rows(args.quick) if args.solve_scope else rows_for(args.quick)
    name = "solve_scope_cost" if args.solve_scope else NAME
    started = time.perf_counter()
    info = machine_info()
    info["loadavg_1_5_15_start"] = list(os.getloadavg())
    runs: dict[str, list[dict[str, Any]]] = {row.key: [] for row in rows}
    sys.path.insert(0, str(ROOT))
    from miniature.recipe import write_prompt_files

    # A smoke run checks the path, not the speed: its rows run two processes at a time.
    parallel = 2 if args.quick else 1
    with (
        tempfile.TemporaryDirectory(prefix="bench_engine_cost_") as tmp,
        ThreadPoolExecutor(parallel) as pool,
    ):
        prompts = write_prompt_files(Path(tmp) / "prompts")
        for round_index in range(rounds):
            shift = round_index % len(rows)
            ordered = rows[shift:] + rows[:shift]
            tags = [f"{row.key}_r{round_index}" for row in ordered]
            launched = [
                pool.submit(run_once, row, epochs, Path(tmp), tag, prompts)
                for row, tag in zip(ordered, tags, strict=True)
            ]
            for row, tag, future in zip(ordered, tags, launched, strict=True):
                run = future.result()
                runs[row.key].append(run)
                print(
                    f"[{time.perf_counter() - started:6.0f} s] {tag}: train "
                    f"{run['train_s']:.3f} s/epoch, epoch {run['epoch_s']:.3f} s, "
                    f"probe {run['probe_s']:.3f} s, solved {run['solved']}/{run['steps']}, "
                    f"engines {run['engines']}, peak {run['peak_rss_mib']:.0f} MiB",
                    flush=True,
                )
    info["loadavg_1_5_15_end"] = list(os.getloadavg())
    info["torch_threads"] = 1  # what the measured processes used
    payload = {
        "benchmark": name,
        "machine": info,
        "total_seconds": time.perf_counter() - started,
        "config": {"rounds": rounds, "epochs": epochs, "quick": args.quick},
        "targets": {f"{o}/{s}": t for (o, s), t in TARGETS.items()},
        "rows": summarize(runs, rows),
    }
    publish(name, payload, render_markdown(payload), args.out, args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
