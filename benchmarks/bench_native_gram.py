"""What the compiled float32 Gram kernel buys: MGDA calls and CPU training steps, with and without.

Why: the kernel (``mogradient/native_gram.py``, the default for CPU float32 stacks) compiles
C at first use and never serves a GPU; whether it stays rests on what it saves end to end.
Each round times every variant once, in rotated order, the kernel switched on or off
(``MOGRADIENT_NATIVE``) between timed calls, never inside one; on two threads, then one:

* call: ``MGDA()`` on K x D float32 stacks (Gram, QP, direction), the Gram alone, and
  TorchJD's ``MGDA()`` for scale; 5 x 35840 is the miniature recipe's LoRA stack;
* step: one CPU training step of a ~2e7-parameter MLP with K = 5 losses, MGDA solving:
  forward, K backward passes (``objective_gradients``), ``MGDA()``, ``write_gradient``, SGD.

Run: ``python benchmarks/bench_native_gram.py [--quick] [--out DIR]``; ``--quick`` (small
shapes, 3 rounds) writes nothing unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torchjd.aggregation as tja
from common import machine_info, machine_markdown, markdown_table, publish
from torch import nn

from mogradient import MGDA, native_gram, objective_gradients, write_gradient
from mogradient.gram import accumulate_gram

NAME = "native_gram"
# (K, D) of the calls: the headline case, a wider K, a mid-size stack, the miniature's.
FULL_CALLS = ((5, 20_000_000), (10, 20_000_000), (5, 1_000_000), (5, 35_840))
QUICK_CALLS = ((5, 200_000), (5, 35_840))
# (inputs, hidden, batch): 768 -> 4096 -> 4096 -> K is 19,951,621 parameters.
FULL_MLP = (768, 4096, 32)
QUICK_MLP = (128, 512, 8)
NUM_LOSSES = 5
# A variant is (kernel on?, function); None: the kernel plays no part (TorchJD).
Variant = tuple[bool | None, Callable[[], Any]]


def use_kernel(enabled: bool) -> None:
    """Switch the kernel through its documented switch, and load it (outside any timer)."""
    os.environ["MOGRADIENT_NATIVE"] = "1" if enabled else "0"
    native_gram._library.cache_clear()
    if native_gram.available() != enabled:
        raise RuntimeError("the Gram kernel could not be built on this machine")


def timed_rounds(variants: dict[str, Variant], rounds: int) -> dict[str, dict[str, list[float]]]:
    """Wall and process-CPU seconds per variant; every round runs each once, rotated.

    Each variant runs once untimed first (the kernel's load, torch's first-call set-up).
    """
    times: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in variants}
    names = list(variants)
    for round_index in range(-1, rounds):
        shift = max(round_index, 0) % len(names)
        for name in names[shift:] + names[:shift]:
            kernel, function = variants[name]
            use_kernel(bool(kernel))
            wall, cpu = time.perf_counter(), time.process_time()
            function()
            if round_index >= 0:
                times[name]["cpu"].append(time.process_time() - cpu)
                times[name]["wall"].append(time.perf_counter() - wall)
    return times


def summary(samples: dict[str, list[float]]) -> dict[str, Any]:
    """Median and fastest wall time, median process CPU time (ms), and the raw wall samples."""
    return {
        "median_ms": 1000.0 * statistics.median(samples["wall"]),
        "min_ms": 1000.0 * min(samples["wall"]),
        "cpu_median_ms": 1000.0 * statistics.median(samples["cpu"]),
        "times_ms": [1000.0 * value for value in samples["wall"]],
    }


def call_case(num_objectives: int, dim: int, rounds: int) -> dict[str, Any]:
    """``MGDA()`` and the Gram alone on one float32 stack, with and without the kernel."""
    generator = torch.Generator().manual_seed(num_objectives * 7919 + dim)
    scales = 10.0 ** torch.empty(num_objectives, 1).uniform_(-1, 1, generator=generator)
    stack = torch.randn(num_objectives, dim, generator=generator).mul_(scales)
    ours, theirs = MGDA(), tja.MGDA()
    variants: dict[str, Variant] = {
        "MGDA() kernel": (True, lambda: ours(stack)),
        "MGDA() torch": (False, lambda: ours(stack)),
        "Gram kernel": (True, lambda: accumulate_gram(stack)),
        "Gram torch": (False, lambda: accumulate_gram(stack)),
        "TorchJD MGDA()": (None, lambda: theirs(stack)),
    }
    times = timed_rounds(variants, rounds)
    exact = torch.zeros(num_objectives, num_objectives, dtype=torch.float64)
    for start in range(0, dim, 1 << 20):
        piece = stack[:, start : start + (1 << 20)].double()
        exact += piece @ piece.T
    errors = {}
    for variant in ("kernel", "torch"):
        use_kernel(variant == "kernel")
        error = (accumulate_gram(stack) - exact).abs().max() / exact.diagonal().max()
        errors[variant] = float(error)
    use_kernel(False)
    return {
        "num_objectives": num_objectives,
        "dim": dim,
        "rounds": rounds,
        "times": {name: summary(samples) for name, samples in times.items()},
        "gram_max_error_over_largest_entry": errors,
    }


def step_case(widths: tuple[int, int, int], rounds: int) -> dict[str, Any]:
    """One CPU training step of an MLP with K losses, MGDA solving, with and without."""
    inputs, hidden, batch = widths
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(inputs, hidden),
        nn.GELU(),
        nn.Linear(hidden, hidden),
        nn.GELU(),
        nn.Linear(hidden, NUM_LOSSES),
    )
    parameters = list(model.parameters())
    optimizer = torch.optim.SGD(parameters, lr=1e-4)
    features, targets = torch.randn(batch, inputs), torch.randn(batch, NUM_LOSSES)
    mgda = MGDA()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        losses = ((model(features) - targets) ** 2).mean(dim=0)
        stack = objective_gradients(losses, parameters)
        write_gradient(parameters, mgda(stack).direction)
        optimizer.step()

    times = timed_rounds({"step kernel": (True, step), "step torch": (False, step)}, rounds)
    return {
        "widths": list(widths),
        "parameters": sum(parameter.numel() for parameter in parameters),
        "rounds": rounds,
        "times": {name: summary(samples) for name, samples in times.items()},
    }


def run_all(quick: bool) -> dict[str, Any]:
    """Every case on two threads (where the machine has them), then on one."""
    calls, mlp = (QUICK_CALLS, QUICK_MLP) if quick else (FULL_CALLS, FULL_MLP)
    call_rounds, step_rounds = (3, 3) if quick else (21, 9)
    before = torch.get_num_threads()
    by_threads = {}
    try:
        for threads in sorted({min(2, os.cpu_count() or 1), 1}, reverse=True):
            torch.set_num_threads(threads)
            print(f"{threads} thread(s) ...", flush=True)
            by_threads[str(threads)] = {
                "calls": [call_case(k, d, call_rounds) for k, d in calls],
                "step": step_case(mlp, step_rounds),
            }
    finally:
        torch.set_num_threads(before)
    return by_threads


def _saving(times: dict[str, Any], kernel: str, plain: str) -> tuple[float, float]:
    """(ms saved by the kernel, saved / the time without it), from the medians."""
    saved = times[plain]["median_ms"] - times[kernel]["median_ms"]
    return saved, saved / times[plain]["median_ms"]


def render_markdown(payload: dict[str, Any]) -> str:
    header = [
        "threads",
        "K",
        "D",
        "MGDA() kernel ms",
        "MGDA() torch ms",
        "saved ms",
        "saved / torch",
        "TorchJD MGDA() ms",
        "kernel / TorchJD",
        "torch / TorchJD",
        "Gram kernel ms",
        "Gram torch ms",
        "Gram error kernel",
        "Gram error torch",
    ]
    call_rows, step_rows = [], []
    inputs, hidden, _ = next(iter(payload["threads"].values()))["step"]["widths"]
    for threads, result in payload["threads"].items():
        for case in result["calls"]:
            times = case["times"]
            saved, share = _saving(times, "MGDA() kernel", "MGDA() torch")
            theirs = times["TorchJD MGDA()"]["median_ms"]
            errors = case["gram_max_error_over_largest_entry"]
            call_rows.append(
                [
                    threads,
                    str(case["num_objectives"]),
                    f"{case['dim']:.4g}",
                    f"{times['MGDA() kernel']['median_ms']:.3g}",
                    f"{times['MGDA() torch']['median_ms']:.3g}",
                    f"{saved:.2g}",
                    f"{share:.0%}",
                    f"{theirs:.3g}",
                    f"{times['MGDA() kernel']['median_ms'] / theirs:.2f}x",
                    f"{times['MGDA() torch']['median_ms'] / theirs:.2f}x",
                    f"{times['Gram kernel']['median_ms']:.3g}",
                    f"{times['Gram torch']['median_ms']:.3g}",
                    f"{errors['kernel']:.1e}",
                    f"{errors['torch']:.1e}",
                ]
            )
        step = result["step"]
        saved, share = _saving(step["times"], "step kernel", "step torch")
        step_rows.append(
            [
                threads,
                f"{step['parameters']:,}",
                str(step["widths"][2]),
                f"{step['times']['step kernel']['median_ms']:.4g}",
                f"{step['times']['step torch']['median_ms']:.4g}",
                f"{step['times']['step kernel']['min_ms']:.4g}",
                f"{step['times']['step torch']['min_ms']:.4g}",
                f"{saved:.2g}",
                f"{share:.1%}",
            ]
        )
    step_header = [
        "threads",
        "parameters",
        "batch",
        "step kernel ms",
        "step torch ms",
        "fastest kernel ms",
        "fastest torch ms",
        "saved ms (medians)",
        "saved / step",
    ]
    return "\n".join(
        [
            "# The compiled float32 Gram kernel: what it buys end to end",
            "",
            machine_markdown(payload["machine"]),
            f"Mode: {payload['mode']}; total run time {payload['total_seconds']:.0f} s.",
            "",
            "## MGDA calls on float32 CPU stacks",
            "",
            "Medians of interleaved rounds (the kernel switched between calls). Gram error: "
            "max |G - G_exact| over the largest entry, G_exact summed in float64.",
            "",
            markdown_table(header, call_rows),
            "",
            "## One CPU training step, MGDA solving every step",
            "",
            f"MLP {inputs} -> {hidden} -> {hidden} -> {NUM_LOSSES} (GELU), K = {NUM_LOSSES} "
            "squared-error losses, sequential engine (K backward passes), `MGDA()`, "
            "`write_gradient`, SGD.",
            "",
            markdown_table(step_header, step_rows),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, 3 rounds")
    parser.add_argument("--out", type=Path, help="results folder (default: benchmarks/results)")
    args = parser.parse_args()
    started = time.perf_counter()
    info = {**machine_info(), "loadavg_1_5_15_start": list(os.getloadavg())}
    results = run_all(args.quick)
    info["loadavg_1_5_15_end"] = list(os.getloadavg())
    payload = {
        "benchmark": NAME,
        "machine": info,
        "mode": "quick" if args.quick else "full",
        "threads": results,
        "total_seconds": time.perf_counter() - started,
    }
    publish(NAME, payload, render_markdown(payload), args.out, args.quick)


if __name__ == "__main__":
    main()
