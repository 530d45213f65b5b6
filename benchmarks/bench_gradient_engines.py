"""Per-objective gradient engines: time and peak memory against one plain backward.

Why: harmonizing needs the K x D stack of per-objective gradients, and how that stack
is computed (K backward passes, one vmapped backward, chunks of it, or the combinable
protocol's cotangents) decides the overhead over ordinary training. The model is a
~2.1M-parameter MLP; its 2 outputs per sample are DiffusionNFT-style branch errors P_i,
N_i shared by K = 5 objectives whose per-sample coefficients (r_ki, 1 - r_ki, masked
mean) come from random advantages, so the same K losses exist both as plain scalars and
as a CombinableLoss.

Run: ``python benchmarks/bench_gradient_engines.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from common import (
    interleaved_times,
    machine_info,
    machine_markdown,
    markdown_table,
    status_kib,
    timing_summary,
    write_results,
)
from torch import nn

from mogradient.combinable import CombinableLoss, masked_mean_coefficients
from mogradient.engines import combinable_gradients, objective_gradients

NAME = "gradient_engines"
NUM_OBJECTIVES = 5
BATCH = 256
INPUT_DIM = 512
WIDTHS = (1024, 1024, 512)
INVALID_FRACTION = 0.1
MEMORY_CALLS = 3
BASELINE = "single backward (sum of losses)"


@dataclass(frozen=True)
class Setup:
    """Model, parameters and one batch with its per-objective coefficients."""

    model: nn.Module
    parameters: list[nn.Parameter]
    inputs: torch.Tensor
    targets: torch.Tensor
    coefficients: torch.Tensor


def make_setup(seed: int = 0) -> Setup:
    """Deterministic MLP and batch; 10% of (objective, sample) rewards are missing (masked)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    width_in = INPUT_DIM
    for width in WIDTHS:
        layers += [nn.Linear(width_in, width), nn.GELU()]
        width_in = width
    layers.append(nn.Linear(width_in, 2))
    model = nn.Sequential(*layers)
    inputs = torch.randn(BATCH, INPUT_DIM)
    targets = torch.randn(BATCH)
    advantages = torch.randn(NUM_OBJECTIVES, BATCH)
    ratio = (0.5 + advantages / 4.0).clamp(0.0, 1.0)
    per_sample = torch.stack([ratio, 1.0 - ratio], dim=1)
    valid = torch.rand(NUM_OBJECTIVES, BATCH) > INVALID_FRACTION
    coefficients = masked_mean_coefficients(per_sample, valid)
    return Setup(model, list(model.parameters()), inputs, targets, coefficients)


def forward_loss(setup: Setup) -> CombinableLoss:
    """Forward pass: per-sample branch errors as terms, the K objectives' coefficients."""
    output = setup.model(setup.inputs)
    terms = (output - setup.targets[:, None]).pow(2).T
    return CombinableLoss(terms=terms, coefficients=setup.coefficients)


def engines(setup: Setup) -> dict[str, Callable[[], torch.Tensor]]:
    """Each engine runs the forward pass and its backward work, returning what it computed."""

    def single() -> torch.Tensor:
        loss = forward_loss(setup).objective_losses().sum()
        return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, setup.parameters)])

    def sequential() -> torch.Tensor:
        losses = forward_loss(setup).objective_losses()
        return objective_gradients(losses, setup.parameters, method="sequential")

    def batched() -> torch.Tensor:
        losses = forward_loss(setup).objective_losses()
        return objective_gradients(losses, setup.parameters, method="batched")

    def batched_chunk2() -> torch.Tensor:
        losses = forward_loss(setup).objective_losses()
        return objective_gradients(losses, setup.parameters, method="batched", chunk_size=2)

    def combinable() -> torch.Tensor:
        return combinable_gradients(forward_loss(setup), setup.parameters, method="batched")

    return {
        BASELINE: single,
        "objective_gradients sequential": sequential,
        "objective_gradients batched": batched,
        "objective_gradients batched chunk_size=2": batched_chunk2,
        "combinable_gradients batched": combinable,
    }


def agreement(setup: Setup) -> dict[str, float]:
    """Max |difference| of each engine's stack from the sequential one (relative to its max)."""
    calls = engines(setup)
    reference = calls["objective_gradients sequential"]()
    scale = float(reference.abs().max())
    result = {}
    for name, call in calls.items():
        if name == BASELINE:
            summed = reference.sum(dim=0)
            result[name] = float((call() - summed).abs().max()) / scale
        else:
            result[name] = float((call() - reference).abs().max()) / scale
    return result


# ----------------------------------------------------------------------------- memory


def child_memory(engine: str) -> dict[str, float]:
    """In a fresh process: resident memory after setup, then the high-water mark of the calls.

    The high-water mark is reset (``/proc/self/clear_refs``) after setup, so that import
    transients cannot hide the engine's peak.
    """
    setup = make_setup()
    call = engines(setup)[engine]
    baseline = status_kib("VmRSS")
    reset = _reset_high_water_mark()
    for _ in range(MEMORY_CALLS):
        call()
    peak = status_kib("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"baseline_mib": baseline / 1024, "peak_mib": peak / 1024, "hwm_reset": reset}


def _reset_high_water_mark() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return status_kib("VmHWM") <= status_kib("VmRSS") + 1024


def measure_memory(engine: str) -> dict[str, float]:
    """Peak RSS of one engine, each in its own interpreter so no allocator state is shared."""
    completed = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", engine],
        check=True,
        capture_output=True,
        text=True,
    )
    measured = json.loads(completed.stdout.strip().splitlines()[-1])
    measured["delta_mib"] = measured["peak_mib"] - measured["baseline_mib"]
    return measured


# ----------------------------------------------------------------------------- report


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}" if base > 0 else "n/a"


def results_table(payload: dict[str, Any]) -> str:
    header = [
        "engine",
        "wall ms",
        "x wall",
        "CPU ms",
        "x CPU",
        "peak RSS MiB",
        "RSS over baseline MiB",
        "x memory",
        "max rel diff",
    ]
    engines_data = payload["engines"]
    base = engines_data[BASELINE]
    rows = []
    for name, data in engines_data.items():
        rows.append(
            [
                name,
                f"{data['median_ms']:.1f}",
                f"{data['median_ms'] / base['median_ms']:.2f}",
                f"{data['cpu_median_ms']:.0f}",
                f"{data['cpu_median_ms'] / base['cpu_median_ms']:.2f}",
                f"{data['peak_mib']:.0f}",
                f"{data['delta_mib']:.0f}",
                _ratio(data["delta_mib"], base["delta_mib"]),
                f"{data['max_rel_diff']:.1e}",
            ]
        )
    return markdown_table(header, rows)


def markdown_report(payload: dict[str, Any]) -> str:
    setup = payload["setup"]
    return f"""# Per-objective gradient engines vs one backward

{machine_markdown(payload["machine"])}
Mode: {payload["mode"]}; total run time {payload["total_seconds"]:.0f} s.

## Setup

MLP {INPUT_DIM} -> {" -> ".join(map(str, WIDTHS))} -> 2 (GELU), {setup["parameters"]:,} parameters,
float32, batch {BATCH}, K = {NUM_OBJECTIVES} objectives. The two outputs give per-sample
branch errors P_i, N_i (squared errors to a random target); objective k's loss is
sum_i m_ki (r_ki P_i + (1 - r_ki) N_i) with r_ki = clip(1/2 + A_ki/4, 0, 1) from random
advantages and m_ki a masked mean ({INVALID_FRACTION:.0%} of rewards missing). The K x D stack
is {setup["stack_mib"]:.0f} MiB.

Every engine call includes the forward pass. Baseline: one `torch.autograd.grad` of the
summed loss (what plain training does). Times: median of {payload["repeats"]} calls per engine
after {payload["warmup"]} warm-up calls, engines interleaved in rotating order each round; wall
time and process CPU time (both threads summed: the steadier number when other jobs share
the cores).
Memory: each engine runs {MEMORY_CALLS} times in a fresh Python subprocess. After building
the model and batch we read VmRSS ("baseline") from /proc/self/status and reset the RSS
high-water mark (`echo 5 > /proc/self/clear_refs`); after the calls we read VmHWM ("peak").
"RSS over baseline" is their difference: forward activations, graph, gradients and the
stack at their peak, plus one-time lazy initialisation common to all engines. Ratios are
against the baseline engine's difference. "max rel diff" is max |stack - sequential stack| /
max |sequential stack| (for the baseline: its gradient vs the sequential stack's column sum).

## Results

{results_table(payload)}
"""


# ----------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="few repeats, for a smoke run")
    parser.add_argument("--out", type=Path, help="results folder (default: benchmarks/results)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child_memory(args.child)))
        return
    started = time.perf_counter()
    load_start = os.getloadavg()
    repeats, warmup = (3, 1) if args.quick else (25, 3)
    setup = make_setup()
    calls = engines(setup)
    interleaved_times(calls, warmup)
    times = interleaved_times(calls, repeats)
    differences = agreement(setup)
    num_parameters = sum(parameter.numel() for parameter in setup.parameters)
    results: dict[str, dict[str, Any]] = {}
    for name in calls:
        print(f"memory: {name} ...", flush=True)
        results[name] = {
            **timing_summary(times[name]),
            "max_rel_diff": differences[name],
            **measure_memory(name),
        }
    payload = {
        "machine": {**machine_info(), "loadavg_1_5_15_start": load_start},
        "mode": "quick" if args.quick else "full",
        "setup": {
            "parameters": num_parameters,
            "batch": BATCH,
            "num_objectives": NUM_OBJECTIVES,
            "stack_mib": NUM_OBJECTIVES * num_parameters * 4 / 2**20,
        },
        "repeats": repeats,
        "warmup": warmup,
        "memory_method": "VmHWM after the calls (reset via clear_refs) minus VmRSS after setup, "
        "fresh subprocess per engine",
        "engines": results,
        "total_seconds": time.perf_counter() - started,
    }
    print("\n" + results_table(payload))
    if args.out is not None or not args.quick:  # a smoke run never replaces results
        json_path, md_path = write_results(NAME, payload, markdown_report(payload), args.out)
        print(f"\nwrote {json_path} and {md_path} ({payload['total_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
