"""Training-loop cost of MARBLE vs the weighted sum: time per optimizer step and peak memory.

Why: MARBLE's claim is that amortizing the MGDA solve (per-objective gradients every
N = 10 optimizer steps, cached smoothed weights in between) keeps training as fast as the
weighted-sum baseline, and that solving every step costs a bounded slowdown. This runs
the real trainer (``python -m mogradient_diffusion.cli train --preset tiny``) with
K = 4 rewards under three strategies side by side:

* ``weighted_sum``: one scalar objective (sum of the rewards), one backward per loss;
* ``marble_amortized``: ``strategy.period=10``, ``strategy.rho=0.7``;
* ``marble_every_step``: ``strategy.period=1`` (K per-objective gradients every step).

Scope: the tiny preset (a randomly initialised miniature SD3, 64 px, 4 sampler steps)
on this CPU, with the offline stand-in rewards. The SD3.5-M-shaped bf16 measurement
the paper's numbers refer to needs a GPU and is not run here.

Every run is a fresh subprocess (same thread settings for all) started through a small
wrapper (``--child``) that times each epoch and optimizer step and reads the RSS
high-water mark from /proc/self/status; strategies are interleaved, in rotated order,
over several rounds.

Run: ``python benchmarks/bench_trainer.py [--rounds 2] [--epochs 16] [--quick]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from common import machine_info, machine_markdown, markdown_table, status_kib, write_results

from mogradient_diffusion.runs import metric_keys as keys
from mogradient_diffusion.training.distributed import World
from mogradient_diffusion.training.trainer import Trainer, TrainerCallback
from mogradient_diffusion.training_config import load_config

NAME = "trainer_tiny_cpu"
# One thread: on this shared 2-core VM other jobs keep the load average above 1, and a
# 2-thread OpenMP team then spends most of its time spinning at barriers (a 256 x 256
# matmul loop measured 0.07 s with 1 thread, 0.07-1.6 s with 2, bimodal across runs);
# 1 thread was stable. --threads overrides it.
THREADS = 1
# jpeg_compressibility is left out: it is jpeg_incompressibility's negative, so the
# weighted sum of the two cancels and every weighted-sum step was skipped for lack of signal.
REWARDS = ("color_match", "count_match", "jpeg_incompressibility", "ocr")
BASELINE = "weighted_sum"
STRATEGIES: dict[str, list[str]] = {
    "weighted_sum": ["strategy.name=weighted_sum"],
    # our whole-step solve, explicitly: the SD3.5-M recipe solves per micro-step as released
    "marble_amortized": [
        "strategy.name=marble",
        "strategy.solve_scope=step",
        "strategy.period=10",
        "strategy.rho=0.7",
    ],
    "marble_every_step": [
        "strategy.name=marble",
        "strategy.solve_scope=step",
        "strategy.period=1",
        "strategy.rho=0.7",
    ],
}
LABELS = {
    "weighted_sum": "weighted sum",
    "marble_amortized": "MARBLE amortized (N=10, rho 0.7)",
    "marble_every_step": "MARBLE every step (N=1)",
}
# Paper targets and reported values, as ratios against the weighted sum (whole training).
PAPER = {
    "marble_amortized": {"throughput_target": 0.99, "throughput_paper": 0.97},
    "marble_every_step": {"throughput_target": 0.80, "throughput_paper": 0.56},
    "memory": {"target": 1.03, "paper": 1.14},
}
TRAIN_BATCH = 2  # 2 prompts x 4 images = 8 samples per epoch -> 4 optimizer steps
WARMUP_EPOCHS = 1


# --------------------------------------------------------------------------- child
def cpu_jiffies() -> tuple[int, int]:
    """(steal, total) jiffies of all CPUs from /proc/stat: how much the hypervisor took."""
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return fields[7], sum(fields)


class Clock:
    """Wall and process CPU time, and the share of CPU the hypervisor stole, over a span."""

    def start(self) -> None:
        self.steal, self.total = cpu_jiffies()
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def stop(self) -> dict[str, float]:
        wall, cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu
        steal, total = cpu_jiffies()
        stolen = (steal - self.steal) / max(1, total - self.total)
        return {"wall_s": wall, "cpu_s": cpu, "steal": stolen}


class TrainingStats(TrainerCallback):
    """Times every epoch and optimizer step, and the memory before and during training."""

    def __init__(self) -> None:
        self.stats: dict[str, Any] = {"epochs": [], "steps": []}
        self.epoch_clock, self.step_clock = Clock(), Clock()

    def on_train_start(self, trainer: Trainer) -> None:
        # Model, rewards and optimizer are built: reset the high-water mark so the
        # training phase's own peak can be told apart from loading.
        self.stats["rss_before_training_kib"] = status_kib("VmRSS")
        self.stats["hwm_before_training_kib"] = status_kib("VmHWM")
        self.stats["trainable_parameters"] = sum(p.numel() for p in trainer.parameters)
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.stats["hwm_reset"] = True
        except OSError:
            self.stats["hwm_reset"] = False

    def on_epoch_start(self, trainer: Trainer) -> None:
        self.epoch_clock.start()

    def on_epoch_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        self.stats["epochs"].append({"epoch": trainer.epoch, **self.epoch_clock.stop()})

    def on_step_start(self, trainer: Trainer, step: list) -> None:
        self.step_clock.start()

    def on_step_end(self, trainer: Trainer, step: list, record: dict[str, Any]) -> None:
        timing = self.step_clock.stop()
        self.stats["steps"].append(
            {"epoch": trainer.epoch, "solved": int(record[keys.SOLVED]), **timing}
        )


def child_main(stats_path: str, cli_args: list[str]) -> int:
    """Train the tiny preset in this process with ``cli_args``, timing epochs and steps
    through a callback; write the stats JSON."""
    callback = TrainingStats()
    config = load_config(preset="tiny", overrides=cli_args)
    world = World.from_environment(config.model.device)
    Trainer(config, world, callbacks=[callback]).run()
    stats = callback.stats
    stats["training_hwm_kib"] = status_kib("VmHWM")
    stats["process_hwm_kib"] = max(stats["hwm_before_training_kib"], stats["training_hwm_kib"])
    Path(stats_path).write_text(json.dumps(stats))
    return 0


# -------------------------------------------------------------------------- parent
def run_once(strategy: str, epochs: int, workdir: Path, tag: str, threads: int) -> dict[str, Any]:
    """One training run in a fresh subprocess; its metrics, wrapper stats and rusage."""
    run_dir = workdir / tag
    stats_path = workdir / f"{tag}.stats.json"
    rewards = "rewards=[" + ", ".join(f"{{name: {name}}}" for name in REWARDS) + "]"
    args = [
        f"run.directory={run_dir}",
        "run.quiet=true",
        f"run.checkpoint_every={epochs + 1}",  # no checkpoints: not what is measured
        f"train.epochs={epochs}",
        f"train.batch_size={TRAIN_BATCH}",
        rewards,
        *STRATEGIES[strategy],
    ]
    env = dict(os.environ)
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[variable] = str(threads)
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["HF_HUB_OFFLINE"] = "1"
    command = [sys.executable, str(Path(__file__).resolve()), "--child", str(stats_path), *args]
    log_path = workdir / f"{tag}.log"
    load_before = os.getloadavg()
    steal, total = cpu_jiffies()
    started = time.perf_counter()
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - started
    steal_after, total_after = cpu_jiffies()
    if process.returncode != 0:
        tail = log_path.read_text()[-3000:]
        raise RuntimeError(f"{tag} failed (exit {process.returncode}):\n{tail}")
    metrics = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    return {
        "strategy": strategy,
        "tag": tag,
        "args": args,
        "process_wall_s": wall,
        "steal_fraction": (steal_after - steal) / max(1, total_after - total),
        "loadavg_1min_before_after": [load_before[0], os.getloadavg()[0]],
        "wait4_maxrss_kib": usage.ru_maxrss,
        "stats": json.loads(stats_path.read_text()),
        "metrics": [_slim(record) for record in metrics],
    }


def _slim(record: dict[str, Any]) -> dict[str, Any]:
    keep = {
        key: value
        for key, value in record.items()
        if key in (keys.STEP, keys.OBJECTIVES_WITHOUT_SIGNAL) or key.startswith(keys.TIMING_PREFIX)
    }
    step_keys = (keys.SOLVED, keys.FALLBACK, keys.BACKWARD_TIME, keys.HARMONIZE_TIME)
    keep[keys.OPTIMIZER_STEPS] = [
        {key: step.get(key) for key in (*step_keys, keys.OPTIMIZER_TIME)}
        for step in record[keys.OPTIMIZER_STEPS]
    ]
    return keep


PHASES = ("rollout", "reward", "backward", "harmonize", "optimizer", "batching")


def epoch_phases(record: dict[str, Any]) -> dict[str, float]:
    """One epoch's seconds by phase; ``train_phase`` = all optimizer steps of the epoch."""
    if keys.BACKWARD_TIME in record:  # time/train spans the whole training phase
        train_phase = record[keys.TRAIN_TIME]
        backward, optimizer = record[keys.BACKWARD_TIME], record[keys.OPTIMIZER_TIME]
    else:  # older trainer: time/train excluded time/harmonize and had no finer split
        train_phase = record[keys.TRAIN_TIME] + record[keys.HARMONIZE_TIME]
        backward, optimizer = record[keys.TRAIN_TIME], 0.0
    harmonize = record[keys.HARMONIZE_TIME]
    return {
        "rollout": record[keys.ROLLOUT_TIME],
        "reward": record[keys.REWARD_TIME],
        "backward": backward,
        "harmonize": harmonize,
        "optimizer": optimizer,
        "batching": train_phase - backward - harmonize - optimizer,
        "train_phase": train_phase,
    }


def summarize_run(run: dict[str, Any]) -> dict[str, Any]:
    """Per-run sums over the measured epochs (epoch >= WARMUP_EPOCHS)."""
    measured = [m for m in run["metrics"] if m[keys.STEP] >= WARMUP_EPOCHS]
    steps = [s for m in measured for s in m[keys.OPTIMIZER_STEPS]]
    phases = [epoch_phases(m) for m in measured]
    component = {key: sum(p[key] for p in phases) for key in PHASES}
    stats = run["stats"]
    wrapper_epochs = [e for e in stats["epochs"] if e["epoch"] >= WARMUP_EPOCHS]
    wrapper_steps = [s for s in stats["steps"] if s["epoch"] >= WARMUP_EPOCHS]
    return {
        "epochs": len(measured),
        "steps": len(steps),
        "solved": sum(int(s[keys.SOLVED]) for s in steps),
        "fallbacks": sum(1 for s in steps if s[keys.FALLBACK]),
        "silent_objectives_per_epoch": statistics.mean(
            len(m[keys.OBJECTIVES_WITHOUT_SIGNAL]) for m in measured
        ),
        "component_s": component,
        "train_phase_s": sum(p["train_phase"] for p in phases),
        # The rollout is the same work for every strategy (same shapes and step count), so
        # its median time is this run's machine-speed reference.
        "rollout_median_s": statistics.median(p["rollout"] for p in phases),
        "reward_seconds": {
            name: sum(m.get(keys.reward_time(name)) or 0.0 for m in measured) for name in REWARDS
        },
        "epoch_wall_s": [e["wall_s"] for e in wrapper_epochs],
        "epoch_cpu_s": [e["cpu_s"] for e in wrapper_epochs],
        "step_wall_s": [s["wall_s"] for s in wrapper_steps],
        "step_cpu_s": [s["cpu_s"] for s in wrapper_steps],
        "step_steal": [s["steal"] for s in wrapper_steps],
        "step_solved": [s["solved"] for s in wrapper_steps],
        "warmup_epoch_wall_s": [e["wall_s"] for e in stats["epochs"] if e["epoch"] < WARMUP_EPOCHS],
        "peak_rss_mib": stats["process_hwm_kib"] / 1024,
        "wait4_maxrss_mib": run["wait4_maxrss_kib"] / 1024,
        "rss_before_training_mib": stats["rss_before_training_kib"] / 1024,
        "training_hwm_mib": stats["training_hwm_kib"] / 1024,
        "training_growth_mib": (stats["training_hwm_kib"] - stats["rss_before_training_kib"])
        / 1024,
        "hwm_reset": stats["hwm_reset"],
        "trainable_parameters": stats["trainable_parameters"],
        "process_wall_s": run["process_wall_s"],
        "steal_fraction": run["steal_fraction"],
    }


def _median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Pool one strategy's rounds: totals over totals, medians, and per-round values."""
    steps = sum(r["steps"] for r in runs)
    epochs = sum(r["epochs"] for r in runs)
    components = {key: sum(r["component_s"][key] for r in runs) / epochs for key in PHASES}
    epoch_walls = [w for r in runs for w in r["epoch_wall_s"]]
    epoch_wall = sum(epoch_walls) / epochs
    step_wall = [w for r in runs for w in r["step_wall_s"]]
    solved_flags = [s for r in runs for s in r["step_solved"]]
    solved_walls = [w for w, s in zip(step_wall, solved_flags, strict=True) if s]
    cached_walls = [w for w, s in zip(step_wall, solved_flags, strict=True) if not s]
    solved_fraction = sum(r["solved"] for r in runs) / steps
    solved_median = _median_or_none(solved_walls)
    cached_median = _median_or_none(cached_walls)
    # Robust to bursts of hypervisor steal: the median step of each kind, mixed in the
    # proportion the schedule runs them.
    robust_step = solved_fraction * (solved_median or 0.0) + (1 - solved_fraction) * (
        cached_median or 0.0
    )
    return {
        "rounds": len(runs),
        "epochs": epochs,
        "steps": steps,
        "train_s_per_step": sum(r["train_phase_s"] for r in runs) / steps,
        "train_s_per_step_rounds": [r["train_phase_s"] / r["steps"] for r in runs],
        "robust_train_s_per_step": robust_step,
        "robust_train_s_per_step_rounds": [_robust_step(r) for r in runs],
        "rollout_median_s_rounds": [r["rollout_median_s"] for r in runs],
        "normalized_train_step": statistics.mean(_normalized(r) for r in runs),
        "normalized_train_step_rounds": [_normalized(r) for r in runs],
        "wrapper_step_wall_s_mean": statistics.mean(step_wall),
        "wrapper_step_cpu_s_mean": statistics.mean(c for r in runs for c in r["step_cpu_s"]),
        "solved_step_wall_s_median": solved_median,
        "cached_step_wall_s_median": cached_median,
        "epoch_wall_s": epoch_wall,
        "epoch_wall_s_rounds": [statistics.mean(r["epoch_wall_s"]) for r in runs],
        "median_epoch_wall_s": statistics.median(epoch_walls),
        "median_epoch_wall_s_rounds": [statistics.median(r["epoch_wall_s"]) for r in runs],
        "epoch_cpu_s": sum(c for r in runs for c in r["epoch_cpu_s"]) / epochs,
        "epoch_components_s": components,
        "reward_seconds_per_epoch": {
            name: sum(r["reward_seconds"][name] for r in runs) / epochs for name in REWARDS
        },
        "epoch_other_s": epoch_wall - sum(components.values()),
        "solved_fraction": solved_fraction,
        "solved_steps": sum(r["solved"] for r in runs),
        "fallbacks": sum(r["fallbacks"] for r in runs),
        "silent_objectives_per_epoch": statistics.mean(
            r["silent_objectives_per_epoch"] for r in runs
        ),
        "steal_fraction_rounds": [r["steal_fraction"] for r in runs],
        "step_steal_mean": statistics.mean(x for r in runs for x in r["step_steal"]),
        "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in runs),
        "peak_rss_mib_rounds": [r["peak_rss_mib"] for r in runs],
        "wait4_maxrss_mib": statistics.median(r["wait4_maxrss_mib"] for r in runs),
        "rss_before_training_mib": statistics.median(r["rss_before_training_mib"] for r in runs),
        "training_growth_mib": statistics.median(r["training_growth_mib"] for r in runs),
        "training_growth_mib_rounds": [r["training_growth_mib"] for r in runs],
        "warmup_epoch_wall_s": statistics.median(w for r in runs for w in r["warmup_epoch_wall_s"]),
        "process_wall_s": statistics.median(r["process_wall_s"] for r in runs),
        "trainable_parameters": runs[0]["trainable_parameters"],
    }


def _normalized(run: dict[str, Any]) -> float:
    """Train-phase seconds per step in units of the same run's median rollout epoch."""
    return run["train_phase_s"] / run["steps"] / run["rollout_median_s"]


def _robust_step(run: dict[str, Any]) -> float:
    pairs = list(zip(run["step_wall_s"], run["step_solved"], strict=True))
    solved = [w for w, s in pairs if s]
    cached = [w for w, s in pairs if not s]
    fraction = len(solved) / len(pairs)
    return fraction * (_median_or_none(solved) or 0.0) + (1 - fraction) * (
        _median_or_none(cached) or 0.0
    )


RATIO_KEYS = {
    # name: (summary key, higher time = worse -> baseline / strategy)
    "train_throughput": "train_s_per_step",
    "robust_train_throughput": "robust_train_s_per_step",
    "normalized_train_throughput": "normalized_train_step",
    "epoch_throughput": "epoch_wall_s",
    "median_epoch_throughput": "median_epoch_wall_s",
}


def ratios(summary: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Throughput (baseline time / strategy time) and memory (strategy / baseline) ratios."""
    base = summary[BASELINE]
    out: dict[str, dict[str, Any]] = {}
    for name, item in summary.items():
        entry: dict[str, Any] = {
            "peak_rss": item["peak_rss_mib"] / base["peak_rss_mib"],
            "training_growth": item["training_growth_mib"] / base["training_growth_mib"],
            "peak_rss_rounds": [
                x / b
                for x, b in zip(
                    item["peak_rss_mib_rounds"], base["peak_rss_mib_rounds"], strict=True
                )
            ],
            "training_growth_rounds": [
                x / b
                for x, b in zip(
                    item["training_growth_mib_rounds"],
                    base["training_growth_mib_rounds"],
                    strict=True,
                )
            ],
        }
        for ratio_name, key in RATIO_KEYS.items():
            entry[ratio_name] = base[key] / item[key]
            entry[ratio_name + "_rounds"] = [
                b / s for b, s in zip(base[key + "_rounds"], item[key + "_rounds"], strict=True)
            ]
        out[name] = entry
    return out


# ------------------------------------------------------------------------ markdown
def _f(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _spread(values: list[float], digits: int = 2) -> str:
    return "–".join(f"{v:.{digits}f}" for v in (min(values), max(values)))


def _verdict(value: float, rounds: list[float], target: float, higher_is_better: bool) -> str:
    """Pooled value against the target, and whether every round agrees."""

    def ok(x: float) -> bool:
        return x >= target if higher_is_better else x <= target

    pooled = "meets" if ok(value) else "misses"
    agreeing = sum(ok(x) == ok(value) for x in rounds)
    if agreeing == len(rounds):
        return f"{pooled} (all {len(rounds)} rounds)"
    return f"{pooled} pooled, but only {agreeing}/{len(rounds)} rounds agree: within noise"


def _source_line(source: dict[str, dict[str, str]]) -> str:
    start, end = source["start"], source["end"]
    if start == end:
        return (
            f"Code: git {start['git_head']} (+ working tree; source digest "
            f"{start['source_sha256']}), unchanged during the runs."
        )
    return (
        f"**Warning: the code changed during the runs** (git {start['git_head']} -> "
        f"{end['git_head']}, digest {start['source_sha256']} -> {end['source_sha256']}): "
        "runs may mix versions."
    )


def observations(summary: dict[str, dict[str, Any]]) -> list[str]:
    """Data-driven sentences: solve cost, where memory goes, where the epoch goes."""
    base, amortized, every = (
        summary[BASELINE],
        summary["marble_amortized"],
        summary["marble_every_step"],
    )
    out = []
    solved, cached = amortized["solved_step_wall_s_median"], amortized["cached_step_wall_s_median"]
    if solved and cached:
        fraction = amortized["solved_fraction"]
        expected = base["cached_step_wall_s_median"] / (fraction * solved + (1 - fraction) * cached)
        out.append(
            f"- In the amortized runs a solved step (K = {len(REWARDS)} per-objective "
            f"gradients + MGDA) took {solved:.3f} s (median) and a cached step {cached:.3f} s: "
            f"a solve costs {solved / cached:.2f}x a cached step. Cached MARBLE steps and "
            "weighted-sum steps do the same work (one backward of a combined loss; weighted "
            f"sum median {base['cached_step_wall_s_median']:.3f} s), so with "
            f"{100 * fraction:.0f}% solved steps the per-step medians predict "
            f"{expected:.2f}x weighted-sum train-phase throughput. Solving every step "
            f"(median {every['solved_step_wall_s_median']:.3f} s) predicts "
            f"{base['cached_step_wall_s_median'] / every['solved_step_wall_s_median']:.2f}x."
        )
    stack_kib = len(REWARDS) * base["trainable_parameters"] * 4 / 1024
    out.append(
        f"- Training growth: weighted sum {base['training_growth_mib']:.1f} MiB, amortized "
        f"{amortized['training_growth_mib']:.1f} MiB ({amortized['solved_steps']} solves in "
        f"{amortized['rounds']} runs), every step {every['training_growth_mib']:.1f} MiB "
        f"({every['solved_steps']} solves). The extra over the weighted sum is the same "
        "whether a run solves 4 or 40 times, so it is a one-time cost (state initialised by "
        "the first per-objective backward / MGDA solve), not per-step data: the K x D "
        f"stack is {stack_kib:.0f} KiB here. At SD3.5-M scale the stack (K x LoRA "
        "parameters) and the retained graph are what the memory target is about; this "
        "toy cannot show them."
    )
    components = base["epoch_components_s"]
    ocr = base["reward_seconds_per_epoch"].get("ocr", 0.0)
    out.append(
        f"- The weighted-sum epoch ({base['epoch_wall_s']:.3f} s) is "
        f"{100 * components['backward'] / base['epoch_wall_s']:.0f}% NFT forward/backward, "
        f"{100 * components['reward'] / base['epoch_wall_s']:.0f}% rewards (of which "
        f"Tesseract OCR {ocr:.3f} s) and "
        f"{100 * components['rollout'] / base['epoch_wall_s']:.0f}% rollout: "
        "the fixed rollout + reward share dilutes any training-phase slowdown in the "
        "whole-epoch ratio."
    )
    return out


def _ratio_cell(entry: dict[str, Any], key: str) -> str:
    return f"{entry[key]:.2f} [{_spread(entry[key + '_rounds'])}]"


def render_markdown(payload: dict[str, Any]) -> str:
    summary, ratio = payload["summary"], payload["ratios"]
    config = payload["config"]
    base = summary[BASELINE]
    steal = [x for item in summary.values() for x in item["steal_fraction_rounds"]]
    lines = [
        "# Training loop: weighted sum vs MARBLE (tiny preset, CPU)",
        "",
        machine_markdown(payload["machine"]),
        _source_line(payload["source"]),
        f"Total benchmark run time {payload['total_seconds']:.0f} s. Hypervisor steal "
        f"(/proc/stat) during the runs: {100 * min(steal):.0f}-{100 * max(steal):.0f}% of "
        "CPU time per run.",
        "",
        "**Scope.** The `tiny` preset (randomly initialised miniature SD3: 64 px, 4 sampler "
        "steps, LoRA rank 4, "
        f"{base['trainable_parameters']:,} trainable parameters) on this "
        f"{payload['machine']['cpu_cores']}-core CPU in float32, with the offline stand-in "
        "rewards (rule-based colour/count checks, JPEG size, Tesseract OCR). The paper's "
        "numbers come from SD3.5-M with bf16 on GPUs; the GPU measurement (SD3.5-M-shaped "
        "model, bf16) needs a machine with a GPU and **was not run**. These numbers say how "
        "the loop's structure behaves at toy scale, not what the paper's setting costs.",
        "",
        "## Setup",
        "",
        f"K = {len(REWARDS)} rewards: {', '.join(f'`{r}`' for r in REWARDS)}. "
        f"Overrides on top of the preset: `train.batch_size={TRAIN_BATCH}` (8 samples per "
        f"epoch -> {config['steps_per_epoch']} optimizer steps per epoch), "
        f"`train.epochs={config['epochs']}`, no checkpoints. Strategies: "
        + "; ".join(f"{LABELS[n]}: `{' '.join(a)}`" for n, a in STRATEGIES.items())
        + ". Same seed for every run, so every strategy sees the same prompts in each epoch.",
        "",
        "Each run is a fresh `python -m mogradient_diffusion.cli train --preset tiny` "
        "process (via this script's `--child` wrapper) with OMP/MKL threads = "
        f"{config['threads']} (1 by default: with other jobs on this 2-core VM a 2-thread "
        "OpenMP team spins at barriers and ran a matmul loop up to ~25x slower, bimodally; "
        "1 thread was stable); "
        f"{config['rounds']} rounds, each running every strategy once in rotated order. "
        "Epoch 0 is warm-up and excluded (first-call costs; its median wall was "
        + ", ".join(
            f"{_f(summary[n]['warmup_epoch_wall_s'], 1)} s for {LABELS[n]}" for n in summary
        )
        + f"). Measured per strategy: {base['epochs']} epochs and {base['steps']} optimizer "
        "steps (pooled over rounds).",
        "",
        "- **train s/step** (the specified metric): the training phase's seconds summed over "
        "measured epochs, divided by the number of optimizer steps, pooled over rounds. The "
        "training phase is `time/train` from `metrics.jsonl` (since commit 98998b7 it spans "
        "all optimizer steps, harmonization included, split into `time/backward`, "
        "`time/harmonize`, `time/optimizer`; with the earlier trainer it was "
        "`time/train + time/harmonize`).",
        "- **median-based train s/step**: the wrapper times every `optimizer_step_on` call; "
        "median solved-step time x solved fraction + median cached-step time x (1 - solved "
        "fraction). Robust to the bursts of hypervisor steal this VM sees (a burst inflates "
        "whichever strategy happens to be running; the sums above absorb it).",
        "- **rollout-normalized**: the rollout is identical work in every run (same shapes "
        "and sampler steps; only the adapter's values differ), so each run's train s/step "
        "divided by its own median rollout time removes the machine's speed at the time of "
        "that run; the ratio of the round means of these normalized values is shown. Needed "
        "because this shared VM's speed drifts between runs (rollout medians per run: "
        + "; ".join(
            f"{LABELS[n]} " + ", ".join(f"{x:.3f}" for x in summary[n]["rollout_median_s_rounds"])
            for n in summary
        )
        + " s).",
        "- **epoch s**: wall time of `Trainer.train_epoch` (wrapper: rollout, rewards, "
        "advantages, all optimizer steps, old-adapter update), mean and median per epoch.",
        "- Throughput ratios: weighted-sum time / strategy time (> 1 = faster), pooled; "
        "per-round ratios (round i vs round i of the weighted sum) in brackets.",
        "",
        "## Results",
        "",
        "### Time",
        "",
    ]
    header = [
        "strategy",
        "train s/step",
        "x train throughput",
        "median-based train s/step",
        "x (median-based)",
        "x (rollout-normalized)",
        "epoch s (mean)",
        "x epoch throughput",
        "epoch s (median)",
        "x (median)",
        "solved steps",
    ]
    rows = []
    for name, item in summary.items():
        r = ratio[name]
        rows.append(
            [
                LABELS[name],
                _f(item["train_s_per_step"]),
                _ratio_cell(r, "train_throughput"),
                _f(item["robust_train_s_per_step"]),
                _ratio_cell(r, "robust_train_throughput"),
                _ratio_cell(r, "normalized_train_throughput"),
                _f(item["epoch_wall_s"]),
                _ratio_cell(r, "epoch_throughput"),
                _f(item["median_epoch_wall_s"]),
                _ratio_cell(r, "median_epoch_throughput"),
                f"{100 * item['solved_fraction']:.0f}% ({item['solved_steps']}/{item['steps']})",
            ]
        )
    lines += [markdown_table(header, rows), "", "### Peak memory", ""]
    header = [
        "strategy",
        "peak RSS MiB",
        "x peak RSS",
        "wait4 ru_maxrss MiB",
        "RSS at training start MiB",
        "training growth MiB",
        "x growth",
    ]
    rows = [
        [
            LABELS[name],
            f"{item['peak_rss_mib']:.0f}",
            f"{ratio[name]['peak_rss']:.3f}",
            f"{item['wait4_maxrss_mib']:.0f}",
            f"{item['rss_before_training_mib']:.0f}",
            f"{item['training_growth_mib']:.1f} [{_spread(item['training_growth_mib_rounds'], 1)}]",
            f"{ratio[name]['training_growth']:.2f}",
        ]
        for name, item in summary.items()
    ]
    lines += [
        markdown_table(header, rows),
        "",
        "Method: the child's `VmHWM` from /proc/self/status at exit (whole process: imports, "
        "model load, training; the Tesseract subprocesses of the OCR reward are not "
        "included), median over rounds; `os.wait4`'s `ru_maxrss` for the same child is the "
        "cross-check. Training growth: when `Trainer.run` starts (model, rewards and "
        "optimizer built) the wrapper reads VmRSS and resets the high-water mark "
        "(`echo 5 > /proc/self/clear_refs`); growth = VmHWM at exit - that VmRSS, i.e. what "
        "training adds (activations, autograd graph, the K x D stack, optimizer state): the "
        "closest CPU analogue of a GPU's peak allocated memory. Whole-process RSS is "
        "dominated by Python, torch, diffusers and the model "
        f"(~{base['rss_before_training_mib']:.0f} MiB before training), so its ratio stays "
        "near 1 whatever training does; the growth is the sharper test but is a few tens "
        "of MiB and moves with allocator noise.",
        "",
        "### Split of the epoch (mean seconds per epoch, share of the epoch wall)",
        "",
    ]
    header = ["strategy", *PHASES, "other", "epoch wall"]
    rows = []
    for name, item in summary.items():
        parts = dict(item["epoch_components_s"], other=item["epoch_other_s"])
        wall = item["epoch_wall_s"]
        rows.append(
            [LABELS[name]]
            + [f"{parts[k]:.3f} ({100 * parts[k] / wall:.0f}%)" for k in (*PHASES, "other")]
            + [f"{wall:.3f}"]
        )
    lines += [
        markdown_table(header, rows),
        "",
        "`rollout`, `reward`: `time/rollout`, `time/reward`. The training phase "
        "(`time/train`) is split into `backward` (`time/backward`: the NFT forward passes "
        "(old, reference, trained adapter) and the backward: one of the combined loss on "
        "cached/weighted-sum steps, the K-row per-objective backward on solved steps), "
        "`harmonize` (`time/harmonize`: MGDA solve, diagnostics, combining the stack), "
        "`optimizer` (`time/optimizer`: clipping, AdamW, EMA) and `batching` (the rest: "
        "cutting micro-batches). `other` = epoch wall - all of these: advantages, the "
        "old-adapter update and bookkeeping.",
        "",
        "### Per optimizer step (wrapper timing of `optimizer_step_on`)",
        "",
    ]
    header = [
        "strategy",
        "median solved step s",
        "median cached step s",
        "mean step s",
        "mean step CPU s",
        "steal during steps",
        "steal per run",
    ]
    rows = [
        [
            LABELS[name],
            _f(item["solved_step_wall_s_median"]),
            _f(item["cached_step_wall_s_median"]),
            _f(item["wrapper_step_wall_s_mean"]),
            _f(item["wrapper_step_cpu_s_mean"]),
            f"{100 * item['step_steal_mean']:.0f}%",
            ", ".join(f"{100 * x:.0f}%" for x in item["steal_fraction_rounds"]),
        ]
        for name, item in summary.items()
    ]
    lines += [
        markdown_table(header, rows),
        "",
        "For the weighted sum every step is a 'cached' step (fixed weights, one backward of "
        "the combined loss). CPU s counts all threads of the process.",
        "",
        "## Against the paper's targets",
        "",
        "Paper: targets amortized >= 0.99x and every-step >= 0.8x weighted-sum throughput, "
        "memory <= 1.03x; reported 0.97x / 0.56x / 1.14x, measured on whole training "
        "throughput (SD3.5-M, GPU). The closest analogue here of whole training throughput "
        "is the epoch ratio (rollout and rewards included); the train-phase ratio isolates "
        "the optimizer steps, where the strategies differ. Values: pooled [per-round range]. "
        "A verdict whose rounds disagree is within this machine's run-to-run noise.",
        "",
    ]
    header = ["quantity", "target", "paper", "tiny CPU (this run)", "status"]
    rows = []
    for name in ("marble_amortized", "marble_every_step"):
        paper = PAPER[name]
        r = ratio[name]
        target = paper["throughput_target"]
        for label, key in (
            ("train-phase throughput", "train_throughput"),
            ("train-phase throughput, rollout-normalized", "normalized_train_throughput"),
            ("epoch throughput", "epoch_throughput"),
        ):
            rows.append(
                [
                    f"{LABELS[name]}: {label}",
                    f">= {target:.2f}x",
                    f"{paper['throughput_paper']:.2f}x",
                    _ratio_cell(r, key) + "x",
                    _verdict(r[key], r[key + "_rounds"], target, True),
                ]
            )
    target = PAPER["memory"]["target"]
    for name in ("marble_amortized", "marble_every_step"):
        r = ratio[name]
        for label, key in (("training growth", "training_growth"), ("peak RSS", "peak_rss")):
            rows.append(
                [
                    f"{LABELS[name]}: {label}",
                    f"<= {target:.2f}x",
                    f"{PAPER['memory']['paper']:.2f}x",
                    f"{r[key]:.3f} [{_spread(r[key + '_rounds'], 3)}]x",
                    _verdict(r[key], r[key + "_rounds"], target, False),
                ]
            )
    lines += [markdown_table(header, rows), "", "## Observations (computed from this run)", ""]
    lines += observations(summary)
    lines += ["", "## Other facts from this run", ""]
    for name, item in summary.items():
        lines.append(
            f"- {LABELS[name]}: {item['fallbacks']} harmonization fallbacks; "
            f"{item['silent_objectives_per_epoch']:.1f} objectives without signal per epoch "
            "on average (NaN or all-equal rewards: `count_match` and `ocr` apply only to "
            "prompts with a number / quoted text, and there are 2 prompts per epoch; the "
            "weighted sum has one objective)."
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- main
REPO = Path(__file__).resolve().parent.parent


def source_state() -> dict[str, str]:
    """Git HEAD and a digest of the trained code, to notice edits made during the runs."""
    digest = hashlib.sha256()
    for package in ("mogradient", "mogradient_diffusion"):
        for path in sorted((REPO / package).rglob("*.py")):
            digest.update(str(path.relative_to(REPO)).encode())
            digest.update(path.read_bytes())
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        head = "unknown"
    return {"git_head": head, "source_sha256": digest.hexdigest()[:16]}


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        return child_main(sys.argv[2], sys.argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=11)
    parser.add_argument("--threads", type=int, default=THREADS, help="OMP/MKL threads per run")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="1 round of 3 epochs, two runs at a time (smoke test; not written)",
    )
    parser.add_argument(
        "--from-json",
        type=Path,
        help="recompute the summaries and the markdown from the raw runs of a result JSON",
    )
    args = parser.parse_args()
    if args.from_json is not None:
        return rerender(args.from_json)
    rounds, epochs = (1, 3) if args.quick else (args.rounds, args.epochs)
    started = time.perf_counter()
    load_start = os.getloadavg()
    source_start = source_state()
    names = list(STRATEGIES)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    raw: list[dict[str, Any]] = []
    # A smoke run checks the path, not the speed: its runs go two processes at a time.
    parallel = 2 if args.quick else 1
    with (
        tempfile.TemporaryDirectory(prefix="bench_trainer_") as tmp,
        ThreadPoolExecutor(parallel) as pool,
    ):
        for round_index in range(rounds):
            shift = round_index % len(names)
            ordered = names[shift:] + names[:shift]
            tags = [f"{name}_r{round_index}" for name in ordered]
            launched = [
                pool.submit(run_once, name, epochs, Path(tmp), tag, args.threads)
                for name, tag in zip(ordered, tags, strict=True)
            ]
            for name, tag, future in zip(ordered, tags, launched, strict=True):
                run = future.result()
                summary = summarize_run(run)
                runs[name].append(summary)
                raw.append({**run, "round": round_index})
                print(
                    f"[{time.perf_counter() - started:6.0f} s] {tag}: "
                    f"train {summary['train_phase_s'] / summary['steps']:.3f} s/step, "
                    f"epoch {statistics.mean(summary['epoch_wall_s']):.3f} s, "
                    f"rollout {summary['rollout_median_s']:.3f} s, "
                    f"steal {100 * summary['steal_fraction']:.0f}%, "
                    f"solved {summary['solved']}/{summary['steps']}, "
                    f"peak RSS {summary['peak_rss_mib']:.0f} MiB "
                    f"(+{summary['training_growth_mib']:.1f} in training)",
                    flush=True,
                )
    summary = {name: aggregate(items) for name, items in runs.items()}
    source_end = source_state()
    if source_end != source_start:
        print(f"WARNING: the code changed during the runs: {source_start} -> {source_end}")
    info = machine_info()
    info["loadavg_1_5_15_start"] = load_start
    info["parent_torch_threads"] = info["torch_threads"]
    info["torch_threads"] = args.threads  # what the measured child processes used
    payload = {
        "benchmark": NAME,
        "machine": info,
        "total_seconds": time.perf_counter() - started,
        "source": {"start": source_start, "end": source_end},
        "config": {
            "preset": "tiny",
            "rewards": list(REWARDS),
            "strategies": STRATEGIES,
            "rounds": rounds,
            "epochs": epochs,
            "warmup_epochs_excluded": WARMUP_EPOCHS,
            "train_batch_size": TRAIN_BATCH,
            "steps_per_epoch": 8 // TRAIN_BATCH,
            "threads": args.threads,
            "gpu_measurement": "not run (needs a GPU: SD3.5-M-shaped model, bf16)",
        },
        "paper": PAPER,
        "summary": summary,
        "ratios": ratios(summary),
        "runs": _compact(raw),
    }
    markdown = render_markdown(payload)
    if args.quick:
        print(markdown)
        return 0
    json_path, md_path = write_results(NAME, payload, markdown)
    print(markdown)
    print(f"wrote {json_path} and {md_path}")
    return 0


def _compact(value: Any) -> Any:
    """Raw per-run data with floats at 6 significant digits (keeps the JSON small)."""
    if isinstance(value, dict):
        return {key: _compact(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_compact(item) for item in value]
    if isinstance(value, float):
        return float(f"{value:.6g}")
    return value


def rerender(path: Path) -> int:
    """Rebuild summaries, ratios and markdown from the raw per-run data of ``path``."""
    payload = json.loads(path.read_text())
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in STRATEGIES}
    for run in payload["runs"]:
        run.pop("summary", None)
        for record in run["metrics"]:
            record.pop("objectives", None)
        for step_records in (m[keys.OPTIMIZER_STEPS] for m in run["metrics"]):
            for record in step_records:
                record.pop(keys.WEIGHTS, None)
    payload["runs"] = _compact(payload["runs"])
    for run in sorted(payload["runs"], key=lambda item: item["round"]):
        runs[run["strategy"]].append(summarize_run(run))
    payload["summary"] = {name: aggregate(items) for name, items in runs.items()}
    payload["ratios"] = ratios(payload["summary"])
    markdown = render_markdown(payload)
    json_path, md_path = write_results(NAME, payload, markdown)
    print(markdown)
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
