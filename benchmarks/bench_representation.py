"""Multi-task backward through shared features: mogradient's trunk and MGDA-UB modes vs
TorchJD's ``mtl_backward``.

Why: ``mogradient.engines.mtl_backward`` gets the trunk's K per-task gradients by
back-propagating the K rows of the features' Jacobian through the trunk (one vmapped pass,
or K plain passes), as TorchJD's ``mtl_backward`` + ``jac_to_grad`` does; its MGDA-UB mode
(Sener & Koltun 2018) instead weighs the K gradients w.r.t. the features and runs one
ordinary backward. This measures what each costs, on the same model and batch, side by
side in one run.

Model: an MLP trunk Linear(256, w) ReLU Linear(w, w) ReLU Linear(w, w) ReLU (w = 180:
~1.1e5 parameters, w = 640: ~9.9e5) and K heads Linear(w, 10), cross-entropy on random
labels. Every method runs forward + its backward on its own copy of the model (``.grad``
set to None first, as in a training step):

* ours, trunk mode: UPGrad on the trunk's K x D Jacobian, one vmapped backward (batched,
  as TorchJD) or K backward passes (sequential, the default);
* ours, MGDA-UB: MGDA on the features' Jacobian, one backward of the weighted sum;
* TorchJD: ``mtl_backward`` + ``jac_to_grad`` with UPGrad, its projector set to the exact
  QP (no trace normalization or 1e-4 ridge), so that both solve the same problem;
* forward + one backward of the summed losses, for scale.

Time: medians over interleaved rounds (:func:`common.interleaved_times`), one thread on
CPU. Memory: on CPU the resident-set high-water mark during one call above the resident
set before it, each case in its own process (``/proc/self/status`` VmHWM, reset through
``/proc/self/clear_refs``; glibc told to map blocks of 64 KiB and more and return them on
free, so the mark follows live memory); on CUDA ``max_memory_allocated`` above the memory
allocated before the call. Exactness: the largest difference between our trunk mode's
and TorchJD's trunk gradients, relative to the largest entry (both float32).

Run: ``python benchmarks/bench_representation.py [--quick] [--device cpu|cuda] [--out DIR]``;
``--quick`` (one tiny case, 3 rounds) prints and writes nothing unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import (
    MEASURING_CHILD_ENV,
    interleaved_times,
    machine_info,
    machine_markdown,
    markdown_table,
    publish,
    status_kib,
    timing_summary,
)
from torch import nn

import mogradient as mg
from mogradient.engines import mtl_backward

NAME = "representation"
INPUTS = 256
CLASSES = 10
METHODS = (
    "ours trunk (batched)",
    "ours trunk (sequential)",
    "ours MGDA-UB",
    "TorchJD",
    "sum backward",
)
FULL_CASES = [
    (tasks, width, batch) for width in (180, 640) for tasks in (2, 4, 8) for batch in (64, 256)
]
QUICK_CASES = [(2, 32, 16)]


class MultiTaskMLP(nn.Module):
    def __init__(self, tasks: int, width: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(
            nn.Linear(INPUTS, width),
            nn.ReLU(),
            nn.Linear(width, width),
            nn.ReLU(),
            nn.Linear(width, width),
            nn.ReLU(),
        )
        self.heads = nn.ModuleList(nn.Linear(width, CLASSES) for _ in range(tasks))

    def forward(
        self, x: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        features = self.trunk(x)
        losses = [
            nn.functional.cross_entropy(head(features), target)
            for head, target in zip(self.heads, labels, strict=True)
        ]
        return features, losses


def steps(
    tasks: int, width: int, batch: int, device: torch.device
) -> tuple[dict[str, Callable[[], None]], dict[str, MultiTaskMLP]]:
    """name -> one training step's forward + backward, each on its own copy of the model."""
    from torchjd.aggregation import UPGrad
    from torchjd.autojac import jac_to_grad
    from torchjd.autojac import mtl_backward as torchjd_mtl_backward
    from torchjd.linalg import QuadprogProjector

    generator = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, INPUTS, generator=generator).to(device)
    labels = torch.randint(CLASSES, (tasks, batch), generator=generator).to(device)
    base = MultiTaskMLP(tasks, width).to(device)
    models = {name: copy.deepcopy(base) for name in METHODS}
    exact = UPGrad(projector=QuadprogProjector(norm_eps=0.0, reg_eps=0.0))

    def ours(name: str, harmonizer: Callable[[], mg.Harmonizer], **options: Any):
        model = models[name]

        def step() -> None:
            model.zero_grad(set_to_none=True)
            features, losses = model(x, labels)
            mtl_backward(losses, features, harmonizer(), **options)

        return step

    def torchjd() -> None:
        model = models["TorchJD"]
        model.zero_grad(set_to_none=True)
        features, losses = model(x, labels)
        shared = list(model.trunk.parameters())
        heads = [list(head.parameters()) for head in model.heads]
        torchjd_mtl_backward(losses, features=features, shared_params=shared, tasks_params=heads)
        jac_to_grad(shared, exact)

    def sum_backward() -> None:
        model = models["sum backward"]
        model.zero_grad(set_to_none=True)
        _, losses = model(x, labels)
        torch.stack(losses).sum().backward()

    functions = {
        "ours trunk (batched)": ours(
            "ours trunk (batched)", mg.harmonizers.UPGrad, method="batched"
        ),
        "ours trunk (sequential)": ours(
            "ours trunk (sequential)", mg.harmonizers.UPGrad, method="sequential"
        ),
        "ours MGDA-UB": ours(
            "ours MGDA-UB", lambda: mg.harmonizers.MGDA(normalize=False), mode="features"
        ),
        "TorchJD": torchjd,
        "sum backward": sum_backward,
    }
    if device.type == "cuda":
        functions = {name: _synchronized(function) for name, function in functions.items()}
    return functions, models


def _synchronized(function: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        function()
        torch.cuda.synchronize()

    return run


def trunk_difference(models: dict[str, MultiTaskMLP]) -> float:
    """Largest |ours - TorchJD| over the trunk's gradient, relative to its largest entry."""
    ours, theirs = (
        torch.cat([p.grad.reshape(-1) for p in models[name].trunk.parameters()])
        for name in ("ours trunk (batched)", "TorchJD")
    )
    return float((ours - theirs).abs().max() / theirs.abs().max())


def run_case(
    tasks: int, width: int, batch: int, rounds: int, device: torch.device
) -> dict[str, Any]:
    functions, models = steps(tasks, width, batch, device)
    for function in functions.values():  # warm-up; leaves every model's .grad set
        function()
    difference = trunk_difference(models)
    times = interleaved_times(functions, rounds)
    return {
        "tasks": tasks,
        "width": width,
        "batch": batch,
        "trunk_parameters": sum(p.numel() for p in models["TorchJD"].trunk.parameters()),
        "timing": {name: timing_summary(samples) for name, samples in times.items()},
        "median_ms": {
            name: timing_summary(samples)["median_ms"] for name, samples in times.items()
        },
        "trunk_vs_torchjd_max_rel_diff": difference,
    }


def peaks_here(tasks: int, width: int, batch: int, device: torch.device) -> dict[str, float]:
    """MiB above the memory before one step, per method (RSS on CPU, allocator on CUDA)."""
    functions, _ = steps(tasks, width, batch, device)
    peaks = {}
    for name, function in functions.items():
        function()
        gc.collect()
        if device.type == "cuda":
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            function()
            peaks[name] = (torch.cuda.max_memory_allocated() - before) / 2**20
        else:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            before = status_kib("VmRSS")
            function()
            peaks[name] = (status_kib("VmHWM") - before) / 1024
    return peaks


def peaks_in_child(tasks: int, width: int, batch: int) -> dict[str, float]:
    """CPU peaks measured in a fresh process whose allocator returns what it frees."""
    command = [sys.executable, __file__, "--memory-child", str(tasks), str(width), str(batch)]
    env = os.environ | MEASURING_CHILD_ENV
    output = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    return json.loads(output.stdout.strip().splitlines()[-1])


def render_markdown(payload: dict[str, Any]) -> str:
    device = payload["device"]
    lines = [
        "# Multi-task backward through shared features: mogradient vs TorchJD",
        "",
        machine_markdown(payload["machine"]),
        "",
        f"Device {device}"
        + (", one thread" if device == "cpu" else "")
        + f"; medians over {payload['rounds']} interleaved rounds of forward + backward "
        "(ms); ratios are to TorchJD's time in the same run. Trunk: UPGrad on the trunk's "
        "Jacobian (ours batched = one vmapped backward like TorchJD's, sequential = K "
        "backward passes, the default; "
        "TorchJD with the exact projector). MGDA-UB: MGDA on the features' Jacobian, one "
        "backward of the weighted sum (an approximation, not the trunk's harmonization). "
        "Peak: memory above that before one step (MiB; "
        + ("resident-set high-water mark" if device == "cpu" else "max_memory_allocated")
        + "). Diff: largest |ours trunk - TorchJD| over the trunk's gradient, relative to "
        "its largest entry (float32).",
        "",
    ]
    header = [
        "K",
        "trunk params",
        "batch",
        "ours trunk ms",
        "sequential ms",
        "MGDA-UB ms",
        "TorchJD ms",
        "sum bwd ms",
        "trunk / TorchJD (batched, sequential)",
        "MGDA-UB / TorchJD",
        "peak MiB ours / seq / UB / TorchJD / sum",
        "diff",
    ]
    body = []
    for row in payload["rows"]:
        times, peaks = row["median_ms"], row["peak_mib"]
        theirs = times["TorchJD"]
        body.append(
            [
                str(row["tasks"]),
                f"{row['trunk_parameters']:,}",
                str(row["batch"]),
                *(f"{times[name]:.1f}" for name in METHODS),
                f"{times['ours trunk (batched)'] / theirs:.2f}x, "
                f"{times['ours trunk (sequential)'] / theirs:.2f}x",
                f"{times['ours MGDA-UB'] / theirs:.2f}x",
                " / ".join(f"{peaks[name]:.1f}" for name in METHODS),
                f"{row['trunk_vs_torchjd_max_rel_diff']:.1e}",
            ]
        )
    return "\n".join([*lines, markdown_table(header, body), ""])


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--memory-child":
        torch.set_num_threads(1)
        tasks, width, batch = (int(value) for value in sys.argv[2:5])
        print(json.dumps(peaks_here(tasks, width, batch, torch.device("cpu"))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="one tiny case, 3 rounds")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--out", type=Path, help="results folder (default: benchmarks/results)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    start_load = os.getloadavg()
    rounds = 3 if args.quick else 15
    rows = []
    for tasks, width, batch in QUICK_CASES if args.quick else FULL_CASES:
        row = run_case(tasks, width, batch, rounds, device)
        row["peak_mib"] = (
            peaks_in_child(tasks, width, batch)
            if device.type == "cpu"
            else peaks_here(tasks, width, batch, device)
        )
        rows.append(row)
        print(json.dumps({key: row[key] for key in row if key != "timing"}), flush=True)
    info = machine_info() | {"loadavg_1_5_15_start": start_load}
    if device.type == "cpu":
        info["torch_threads"] = 1
    else:
        info["gpu"] = torch.cuda.get_device_name(device)
    payload = {
        "benchmark": NAME,
        "mode": "quick" if args.quick else "full",
        "device": device.type,
        "machine": info,
        "rounds": rounds,
        "rows": rows,
    }
    publish(NAME, payload, render_markdown(payload), args.out, args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
