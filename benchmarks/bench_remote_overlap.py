"""What overlapping remote scoring with sampling saves, on the miniature's recipe.

Why: a reward served elsewhere (a GPU reward model, official GenEval, a VLM judge) answers
after a service time the trainer cannot shorten. Scored after sampling, an epoch waits for
all of it; with ``rollout.overlap_rewards`` each sampled chunk is sent while the next one
samples (two chunks in flight, every remote reward at once), and the epoch waits only for
what is left when sampling ends.

Each of the miniature's five training rewards is served on 127.0.0.1 by ``serve-reward``'s
app (our protocol: PNG of the images rounded to 8 bits, see below) under uvicorn, in this
process, wrapped to take ``--latency`` seconds (default 0.5) per request on top of its own
compute. Like ``serve-reward`` (and a reward model on one GPU) a server scores one request
at a time, so requests to one server queue; the five servers answer in parallel. The
rollout samples chunks of 16 images, the client sends 16 images a request: one request per
reward and chunk, four per epoch.

The real trainer runs the miniature recipe (``miniature/config.yaml``, shipped base model,
prompts from ``miniature.recipe.write_prompt_files``) in a process of its own with one
thread, rows interleaved over rounds in rotated order:

* ``remote_sequential``: the rewards remote, scored after sampling;
* ``remote_overlap``: the same with ``rollout.overlap_rewards=true``;
* ``in_process_sequential`` and ``in_process_overlap``: the rewards in the trainer, for
  reference.

It reads ``time/*`` from each run's ``metrics.jsonl`` (the first epoch is left out:
start-up): epoch s = ``time/rollout + time/reward + time/train``, scoring wait =
``time/reward`` (with overlap, only the wait after sampling). The speed-up is the
sequential row's epoch seconds over the overlapped row's, each row's fastest round. Every
row should log the reward means of ``in_process_sequential`` (same seed): the table says
the largest difference, which is round-off: served rewards see the images rounded to 8
bits (PNG, as any saved image) where the miniature's learned rewards read float pixels in
process, and a learned model's round-off depends on how many images it scores at once
(overlap scores chunks).

Run: ``python benchmarks/bench_remote_overlap.py [--rounds 3] [--epochs 5] [--latency 0.5]``;
``--quick`` (one round of 2 epochs, the remote rows only, their means compared with
``remote_sequential``'s) prints its table and writes nothing unless ``--out`` is given.
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
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from common import machine_info, machine_markdown, markdown_table, publish

from mogradient_diffusion.rewards import Reward, make_reward
from mogradient_diffusion.runs import metric_keys as keys

NAME = "remote_overlap"
ROOT = Path(__file__).resolve().parents[1]
MINI = ROOT / "miniature"
ROWS = ("remote_sequential", "remote_overlap", "in_process_sequential", "in_process_overlap")
CHUNK = 16  # images sampled at once (the recipe's rollout.batch_size) and sent per request


class Delayed(Reward):
    """``inner`` after ``seconds`` of service time per call: a slower model, or one on a
    busy GPU, behind the same protocol."""

    def __init__(self, inner: Reward, seconds: float) -> None:
        super().__init__()
        self.inner, self.seconds = inner, seconds
        self.name, self.value_range = inner.name, inner.value_range

    def score(self, images, prompts, metadata):
        time.sleep(self.seconds)
        return self.inner(images, prompts, metadata)


def rewards_override(urls: dict[str, str] | None) -> list[str]:
    """The rows' reward list: the recipe's (in process), or each served, under its name."""
    if urls is None:
        return []
    entries = [
        f"{{name: remote, label: {name}, options: {{url: '{url}', batch_size: {CHUNK}}}}}"
        for name, url in urls.items()
    ]
    return [f"rewards=[{', '.join(entries)}]"]


def command_for(row: str, run_dir: Path, epochs: int, prompts: Path, urls: dict[str, str]):
    cli = [sys.executable, "-m", "mogradient_diffusion.cli", "train"]
    base = ["--config", str(MINI / "config.yaml"), f"model.path={MINI / 'base_model'}"]
    overlap = row.endswith("_overlap")
    return [
        *cli,
        *base,
        f"prompts.directory={prompts}",
        f"run.directory={run_dir}",
        "run.quiet=true",
        f"run.checkpoint_every={epochs + 1}",  # no checkpoint writes: not what is timed
        f"train.epochs={epochs}",
        f"rollout.batch_size={CHUNK}",
        f"rollout.overlap_rewards={str(overlap).lower()}",
        *rewards_override(urls if row.startswith("remote") else None),
    ]


def run_once(command: list[str], run_dir: Path, log: Path) -> dict[str, Any]:
    """One training process (one thread): per-epoch times after the first, reward means."""
    env = os.environ | {
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TQDM_DISABLE": "1",
    }
    with log.open("w") as out:
        status = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
    if status != 0:
        raise RuntimeError(f"{run_dir.name} failed:\n{log.read_text()[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = records[1:] if len(records) > 1 else records
    means = {
        key: [record[key] for record in records]
        for key in records[0]
        if keys.reward_of_mean(key) is not None
    }
    return {
        "epoch_s": statistics.mean(
            r[keys.ROLLOUT_TIME] + r[keys.REWARD_TIME] + r[keys.TRAIN_TIME] for r in timed
        ),
        "reward_s": statistics.mean(r[keys.REWARD_TIME] for r in timed),
        "rollout_s": statistics.mean(r[keys.ROLLOUT_TIME] for r in timed),
        "train_s": statistics.mean(r[keys.TRAIN_TIME] for r in timed),
        "means": means,
    }


def largest_difference(means: dict[str, list], reference: dict[str, list]) -> float:
    """The largest |difference| of a reward mean in any epoch; inf where a reward, or a
    value, is missing on one side only (None: NaN in metrics.jsonl)."""
    if set(means) != set(reference):
        return float("inf")
    largest = 0.0
    for key, values in reference.items():
        for mine, theirs in zip(means[key], values, strict=True):
            if (mine is None) != (theirs is None):
                return float("inf")
            if mine is not None:
                largest = max(largest, abs(mine - theirs))
    return largest


def summarize(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per row: its fastest round, the speed-up over its sequential row, the agreement."""
    fields = ("epoch_s", "reward_s", "rollout_s", "train_s")
    fastest = {row: {f: min(run[f] for run in runs[row]) for f in fields} for row in runs}
    reference = runs.get("in_process_sequential", runs["remote_sequential"])[0]["means"]
    table = []
    for row, items in runs.items():
        sequential = fastest[row.replace("_overlap", "_sequential")]
        difference = max(largest_difference(run["means"], reference) for run in items)
        table.append(
            {
                "row": row,
                **fastest[row],
                "speedup": sequential["epoch_s"] / fastest[row]["epoch_s"],
                "median": {f: statistics.median(run[f] for run in items) for f in fields},
                "max_mean_difference": difference,
                "rounds": [{f: run[f] for f in fields} for run in items],
            }
        )
    return table


def render_markdown(payload: dict[str, Any]) -> str:
    config = payload["config"]
    names = [entry["row"] for entry in payload["rows"]]
    reference = "in_process_sequential" if "in_process_sequential" in names else names[0]
    lines = [
        "# Remote rewards: scoring overlapped with sampling (miniature recipe, CPU)",
        "",
        machine_markdown(payload["machine"]),
        "",
        f"{config['rounds']} interleaved round(s) of {config['epochs']} epochs per row; the "
        "first epoch of each run is left out; each row's fastest round. The five training "
        f"rewards served on 127.0.0.1 (our protocol), each server {config['latency']:g} s "
        "per request and one request at a time; 64 images an epoch sampled in 4 chunks of "
        f"{CHUNK}, {CHUNK} images a request. Scoring wait: `time/reward` (with overlap, what "
        "is left after sampling). Speed-up: the sequential row's epoch seconds over the "
        "row's. Means: the largest difference of a reward mean from "
        f"`{reference}` in any epoch (round-off: served rewards see 8-bit images, "
        "the learned ones read float pixels in process; overlap scores chunks).",
        "",
    ]
    header = ["row", "epoch s", "speed-up", "scoring wait s", "rollout s", "train s", "means"]
    body = [
        [
            entry["row"],
            f"{entry['epoch_s']:.3f}",
            f"{entry['speedup']:.2f}x",
            f"{entry['reward_s']:.3f}",
            f"{entry['rollout_s']:.3f}",
            f"{entry['train_s']:.3f}",
            f"{entry['max_mean_difference']:.2g}",
        ]
        for entry in payload["rows"]
    ]
    lines += [markdown_table(header, body), ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--latency", type=float, default=0.5, help="seconds per request")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 1 round, 2 epochs, remote rows only"
    )
    parser.add_argument("--out", type=Path, help="results folder (default: benchmarks/results)")
    args = parser.parse_args()
    rounds, epochs = (1, 2) if args.quick else (args.rounds, args.epochs)
    rows = ROWS[:2] if args.quick else ROWS
    started = time.perf_counter()
    info = machine_info()
    info["loadavg_1_5_15_start"] = list(os.getloadavg())
    torch.set_num_threads(1)  # the servers' share of the machine: one thread, as the trainer
    sys.path.insert(0, str(ROOT))
    from miniature.recipe import TRAIN_REWARDS, write_prompt_files
    from mogradient_diffusion.rewards.remote.server import serving_in_thread

    runs: dict[str, list[dict[str, Any]]] = {row: [] for row in rows}
    with tempfile.TemporaryDirectory(prefix="bench_remote_overlap_") as tmp, ExitStack() as stack:
        prompts = write_prompt_files(Path(tmp) / "prompts")
        urls = {
            name: stack.enter_context(
                serving_in_thread(Delayed(make_reward(name), args.latency), CHUNK)
            )
            for name in TRAIN_REWARDS
        }
        for round_index in range(rounds):
            shift = round_index % len(rows)
            for row in rows[shift:] + rows[:shift]:
                tag = f"{row}_r{round_index}"
                run_dir = Path(tmp) / tag
                command = command_for(row, run_dir, epochs, prompts, urls)
                run = run_once(command, run_dir, Path(tmp) / f"{tag}.log")
                runs[row].append(run)
                print(
                    f"[{time.perf_counter() - started:6.0f} s] {tag}: epoch {run['epoch_s']:.3f} "
                    f"s, scoring wait {run['reward_s']:.3f} s, rollout {run['rollout_s']:.3f} s",
                    flush=True,
                )
    info["loadavg_1_5_15_end"] = list(os.getloadavg())
    info["torch_threads"] = 1  # what the measured processes used
    payload = {
        "benchmark": NAME,
        "machine": info,
        "total_seconds": time.perf_counter() - started,
        "config": {
            "rounds": rounds,
            "epochs": epochs,
            "latency": args.latency,
            "chunk": CHUNK,
            "quick": args.quick,
        },
        "rows": summarize(runs),
    }
    publish(NAME, payload, render_markdown(payload), args.out, args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
