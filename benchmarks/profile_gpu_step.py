"""Where the time of one training step and one rollout goes on a GPU, at the SD3.5-M shape.

Why: ``bench_gpu.py`` measured 15.7% training MFU (weighted sum) and 17.6% rollout MFU on
an H100 (docs/benchmarks/gpu.md) but not why. This script runs the same model, Trainer
and weighted-sum row as ``bench_gpu`` (built by its own functions: batch 9, bf16 on a
GPU, checkpointing off, 10 sampler steps) and puts ``torch.profiler`` around one rollout
call and a few optimizer steps, then the MARBLE every-step row (per-row engine) if the
budget leaves time. For each it writes the top ops by self device time (self CPU time
on a CPU), totals per op category (GEMM, attention, elementwise, ...), how long the GPU
was busy against the unprofiled wall time of the same call (the idle share tells
launch-bound from compute-bound) and the kernel launches per call.

The events are aggregated straight from the profiler's raw (kineto) events: a training
step at this shape issues close to a million ops, which the profiler's own
``events()``/``key_averages()`` post-processing takes minutes to parse. No chrome trace
is written (too big to bring back from a lease).

Built for one device call with a hard wall limit: the JSON and markdown are rewritten
after every stage, a failing stage is recorded and the next one goes on, and ``--budget``
skips (and says so) profiled calls that would not finish in time; the cost of profiling
is measured on the rollout and used to plan the training stages. ``--quick`` runs the
shape's tiny twin (CPU, seconds): a smoke run of the script, never a result.

Run on a GPU: ``python benchmarks/profile_gpu_step.py --out DIR --budget 180`` (on a lent
machine with the repository and the carried diffusers wheel on PYTHONPATH, as
``benchmarks/gpu_lease.sh`` puts them; ``--steps`` sets the profiled steps per row).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from bench_gpu import (
    BASELINE,
    SHAPES,
    SMALL_OF,
    Shape,
    StepTimer,
    build_trainer,
    describe_error,
    describe_setup,
    device_info,
    measure_matmul_peak,
    run_epoch,
    set_checkpointing,
    synchronize,
    timed,
    versions,
    write_atomically,
)
from bench_gpu import parse_args as bench_arguments
from bench_trainer import _compact, source_state
from common import markdown_table
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from mogradient.engines import GradientEngine
from mogradient_diffusion.objectives import TrainPiece
from mogradient_diffusion.runs import metric_keys as keys
from mogradient_diffusion.sampling.rollout import rollout
from mogradient_diffusion.training.distributed import World
from mogradient_diffusion.training.trainer import Trainer, TrainerCallback

MARBLE = "marble_every_step"
TOP_OPS = 25
MARGIN_S = 5.0  # kept back from --budget for the last writes
# Until the rollout has measured them: profiled wall time and post-processing time per
# second of the unprofiled call (guesses), and a safety factor on every estimate.
DEFAULT_PROFILED_RATIO = 3.0
DEFAULT_PROCESSING_RATIO = 2.0
SAFETY = 1.5
# A MARBLE every-step row's step, and its first (warm-up) step that also checks the
# per-row engine against K backward passes once, in weighted-sum steps: on the H100,
# 11.9 s and 11.9 + 15.9 s against 6.82 s (docs/benchmarks/gpu.md).
MARBLE_STEP = 1.75
MARBLE_WARMUP_STEP = 4.1
# Device-side records of host synchronizations, not work (recorded by some torch builds).
SYNC_RECORDS = ("Context Sync", "Stream Sync", "Event Sync", "Stream Wait Event")

CATEGORIES = (
    "matmul/GEMM",
    "attention",
    "convolution",
    "elementwise/normalization",
    "optimizer",
    "other",
)
MATMUL_OPS = frozenset(
    "mm addmm bmm baddbmm addbmm matmul linear addmm_activation addmv mv dot einsum "
    "scaled_mm".split()
)
# Pointwise, normalization, copy, cast, reduction and RNG ops: memory-bound work.
MEMORY_BOUND_OPS = frozenset(
    "add sub rsub mul div neg exp log pow sqrt rsqrt reciprocal tanh sigmoid silu gelu relu "
    "threshold abs sign clamp clamp_min clamp_max where maximum minimum lerp addcmul addcdiv "
    "square sin cos erf fill zero zeros ones zeros_like ones_like copy to to_copy contiguous "
    "clone cat stack sum mean var std amax amin max min isfinite isnan all any eq ne gt lt "
    "ge le masked_fill nan_to_num softmax log_softmax dropout native_dropout normal uniform "
    "randn rand randn_like exponential floor_divide remainder round floor ceil softplus".split()
)
UNATTRIBUTED = "(device work outside any profiled op)"
ENGINES = {"rows": "per-row engine", "batched": "K backward passes"}  # GradientEngine.name


# ------------------------------------------------------------------ categories
@functools.cache
def category(name: str) -> str:
    """The category of an op by its name alone (``optimizer`` also comes from ancestry)."""
    base = name.removeprefix("aten::")
    if "_foreach_" in base or "adam" in base.lower():
        return "optimizer"
    if "attention" in base or "flash" in base:
        return "attention"
    core = base.strip("_").removesuffix("_backward_data").removesuffix("_backward").strip("_")
    if core in MATMUL_OPS:
        return "matmul/GEMM"
    if "conv" in core:
        return "convolution"
    if core in MEMORY_BOUND_OPS or "norm" in core or "softmax" in core:
        return "elementwise/normalization"
    return "other"


# -------------------------------------------------------------------- analysis
@dataclass(slots=True)
class Op:
    """One profiled op (a CPU-side event) and what it is charged with."""

    name: str
    start: int
    end: int
    correlation: int
    flops: int
    children_ns: int = 0
    under_optimizer: bool = False


@dataclass(slots=True)
class Work:
    """One kernel or copy on the device, and the op that launched it."""

    name: str
    start: int
    end: int
    op: int  # the launching op's correlation id
    record: int  # its own correlation id: that of its launch call


@dataclass(slots=True)
class Total:
    """What one (op name, category) pair adds up to."""

    calls: int = 0
    self_us: float = 0.0
    flops: int = 0


def analyse(events: Sequence[Any], on_device: bool, calls: int) -> dict[str, Any]:
    """Per-call totals of the raw profiler events: top ops, categories, device busy time.

    On a GPU an op's self time is the duration of the kernels (and copies) it launched
    itself; on a CPU its duration minus its children's. Ops under torch's ``Optimizer.*``
    annotations count as optimizer work whatever their name.
    """
    ops: dict[int, list[Op]] = {}  # per thread
    device_work: list[Work] = []
    launches: set[int] = set()  # correlation ids of the kernel launch calls
    # Profiler internals that torch hides from its own tables (a flag of newer builds),
    # looked up once: a step has about a million events.
    is_hidden = getattr(type(events[0]), "is_hidden_event", None) if events else None
    for event in events:
        name = event.name()
        if name.startswith("[") or (is_hidden is not None and is_hidden(event)):
            continue  # memory records, hidden internals
        if event.device_type() != DeviceType.CPU:
            # Annotations span the gaps between their kernels; syncs are waits.
            if not event.is_user_annotation() and name not in SYNC_RECORDS:
                device_work.append(
                    Work(
                        name,
                        event.start_ns(),
                        event.end_ns(),
                        event.linked_correlation_id(),
                        event.correlation_id(),
                    )
                )
        elif event.linked_correlation_id():  # a CUDA runtime or driver call made for an op
            if "LaunchKernel" in name:
                launches.add(event.correlation_id())
        elif not event.is_async():
            op = Op(name, event.start_ns(), event.end_ns(), event.correlation_id(), event.flops())
            ops.setdefault(event.start_thread_id(), []).append(op)
    every_op = _nest(ops)
    launched: dict[int, list[int]] = {}  # launching op's correlation: [ns, kernels and copies]
    for work in device_work:
        charge = launched.setdefault(work.op, [0, 0])
        charge[0] += work.end - work.start
        charge[1] += 1
    totals: dict[tuple[str, str], Total] = {}
    for op in every_op:
        if on_device:
            own_ns = launched.pop(op.correlation, (0, 0))[0]
        else:
            own_ns = op.end - op.start - op.children_ns
        kind = "optimizer" if op.under_optimizer else category(op.name)
        total = totals.setdefault((op.name, kind), Total())
        total.calls += 1
        total.self_us += own_ns / 1e3
        total.flops += op.flops
    if launched:  # device work whose launching op was not recorded
        orphans = launched.values()
        totals[(UNATTRIBUTED, "other")] = Total(
            sum(count for _, count in orphans), sum(ns for ns, _ in orphans) / 1e3
        )
    summary = {"calls": calls, **_tables(totals, calls), "cpu_ops_per_call": len(every_op) / calls}
    if on_device:
        summary |= _device_summary(device_work, launches, every_op, calls)
    return summary


def _device_summary(
    device_work: list[Work], launches: set[int], every_op: list[Op], calls: int
) -> dict[str, Any]:
    """Busy time, kernel counts and two checks that no device record was lost: every
    launch call has its kernel, and device records last as long as the ops do."""
    kernels = [work for work in device_work if not work.name.startswith(("Memcpy", "Memset"))]
    kernel_ns = sum(work.end - work.start for work in kernels)
    first = min((op.start for op in every_op), default=0)
    window = max((op.end for op in every_op), default=0) - first
    last_device = max((work.end for work in device_work), default=first)
    return {
        "device_busy_ms": _union_ns(device_work) / 1e6 / calls,
        "kernels_per_call": len(kernels) / calls,
        "copies_per_call": (len(device_work) - len(kernels)) / calls,
        "kernel_launches_per_call": len(launches) / calls,
        "mean_kernel_us": kernel_ns / 1e3 / len(kernels) if kernels else None,
        "launches_without_kernel_record": len(launches - {work.record for work in kernels}),
        "device_records_cover": (last_device - first) / window if window > 0 else None,
    }


def _nest(ops: dict[int, list[Op]]) -> list[Op]:
    """Every op, with its children's time and whether it runs under an optimizer
    annotation, from the nesting of the intervals on each thread."""
    nested: list[Op] = []
    for thread_ops in ops.values():
        thread_ops.sort(key=lambda op: (op.start, -op.end))
        stack: list[Op] = []
        for op in thread_ops:
            while stack and stack[-1].end <= op.start:
                stack.pop()
            if stack:
                stack[-1].children_ns += op.end - op.start
                op.under_optimizer = stack[-1].under_optimizer
            op.under_optimizer = op.under_optimizer or op.name.startswith("Optimizer.")
            stack.append(op)
        nested += thread_ops
    return nested


def _union_ns(device_work: list[Work]) -> int:
    """Nanoseconds during which at least one kernel or copy ran (any stream)."""
    busy, reach = 0, -math.inf
    for start, end in sorted((work.start, work.end) for work in device_work):
        if start > reach:
            busy += end - start
            reach = end
        elif end > reach:
            busy += end - reach
            reach = end
    return int(busy)


def _tables(totals: dict[tuple[str, str], Total], calls: int) -> dict[str, Any]:
    """The top ops and the category totals, per call, with their shares of the total."""
    whole_us = sum(total.self_us for total in totals.values()) or 1.0
    ranked = sorted(totals.items(), key=lambda item: item[1].self_us, reverse=True)
    top = [
        {
            "name": name,
            "category": kind,
            "calls": total.calls / calls,
            "self_ms": total.self_us / 1e3 / calls,
            "percent": 100 * total.self_us / whole_us,
            "gflops": total.flops / 1e9 / calls if total.flops else None,
        }
        for (name, kind), total in ranked[:TOP_OPS]
    ]
    groups = {kind: Total() for kind in CATEGORIES}
    for (_, kind), total in totals.items():
        groups[kind].calls += total.calls
        groups[kind].self_us += total.self_us
        groups[kind].flops += total.flops
    categories = [
        {
            "category": kind,
            "calls": total.calls / calls,
            "self_ms": total.self_us / 1e3 / calls,
            "percent": 100 * total.self_us / whole_us,
            # Counted FLOPs (the profiler counts GEMMs and convolutions, not attention) over
            # the category's own time: what its kernels achieve while they run.
            "tflops": total.flops / total.self_us / 1e6 if total.flops and total.self_us else None,
        }
        for kind, total in sorted(groups.items(), key=lambda item: -item[1].self_us)
    ]
    return {"total_self_ms": whole_us / 1e3 / calls, "top_ops": top, "categories": categories}


# ------------------------------------------------------------------- profiling
@dataclass
class Costs:
    """Profiled wall and post-processing seconds per second of the same call unprofiled:
    measured on the rollout, used to fit the training stages into the budget."""

    profiled: float = DEFAULT_PROFILED_RATIO
    processing: float = DEFAULT_PROCESSING_RATIO

    def profiled_call_s(self, unprofiled_s: float) -> float:
        return SAFETY * unprofiled_s * (self.profiled + self.processing)


def profile_calls(device: torch.device, function: Callable[[], Any], calls: int) -> dict[str, Any]:
    """``calls`` calls of ``function`` under the profiler: the per-call analysis, the
    synchronized wall time per call and the post-processing seconds."""
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    synchronize(device)
    with profile(activities=activities, record_shapes=True, with_flops=True) as profiler:
        started = time.perf_counter()
        for _ in range(calls):
            function()
        synchronize(device)
        ended = time.perf_counter()
    events = profiler.profiler.kineto_results.events()
    summary = analyse(events, device.type == "cuda", calls)
    return {
        "profiled_wall_ms": 1e3 * (ended - started) / calls,
        "processing_s": time.perf_counter() - ended,
        **summary,
    }


class Skipped(Exception):
    """A stage (or its rest) left out for the budget or for a missing input."""


class StepCapture(TrainerCallback):
    """Keeps the last optimizer step the trainer ran, to replay it under the profiler."""

    def __init__(self, trainer: Trainer) -> None:
        self.step: list[TrainPiece] | None = None
        trainer.callbacks = (*trainer.callbacks, self)

    def on_step_start(self, trainer: Trainer, step: list[TrainPiece]) -> None:
        self.step = step


class Run:
    """The payload, the clock and the outputs, rewritten after every stage so that a run
    killed at the device call's limit still returns what it profiled."""

    def __init__(self, args: argparse.Namespace, out: Path, payload: dict[str, Any]) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.started = time.perf_counter()
        self.budget_s = math.inf if args.budget is None else args.budget
        self.payload = payload
        self.costs = Costs()
        out.mkdir(parents=True, exist_ok=True)
        stem = out / f"profile_{payload['device']['slug']}"
        self.json_path, self.md_path = stem.with_suffix(".json"), stem.with_suffix(".md")

    def remaining_s(self) -> float:
        return self.budget_s - (time.perf_counter() - self.started) - MARGIN_S

    def require(self, what: str, estimate_s: float) -> None:
        """Raise Skipped unless ``what`` (about ``estimate_s``) fits in the budget."""
        left = self.remaining_s()
        if estimate_s > left:
            raise Skipped(
                f"{what} not started: about {estimate_s:.0f} s needed, {max(left, 0):.0f} s "
                f"left of the {self.budget_s:.0f} s budget"
            )

    def stage(self, key: str, label: str, function: Callable[[dict[str, Any]], Any]) -> Any:
        """Run ``function(entry)``; its failure or skip is recorded in the entry and the
        run goes on. Returns its result (None when it did not finish)."""
        entry: dict[str, Any] = {"label": label, "status": "running"}
        self.payload["stages"][key] = entry
        self.log(label)
        result, failure = None, None
        try:
            result = function(entry)
            entry["status"] = "ok"
        except Skipped as skip:
            entry["status"] = f"skipped: {skip}"
        except Exception as error:
            failure = describe_error(error)
        if failure is not None:  # out of the handler: the traceback's tensors are freed
            entry["status"] = f"FAILED: {failure}"
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        if entry["status"] != "ok":
            print(f"  {label}: {entry['status']}", flush=True)
        self.write()
        return result

    def log(self, text: str) -> None:
        print(f"[{time.perf_counter() - self.started:6.1f} s] {text}", flush=True)
        self.payload["stage"] = text
        self.write()

    def write(self) -> None:
        self.payload["total_seconds"] = time.perf_counter() - self.started
        text = json.dumps(_compact(self.payload), indent=2, default=str)
        write_atomically(self.json_path, text + "\n")
        write_atomically(self.md_path, render_markdown(self.payload).rstrip() + "\n")


def sample(trainer: Trainer, args: argparse.Namespace, shape: Shape) -> Callable[[], Any]:
    """One rollout call as ``bench_gpu`` times it: the batch through the sampler, then the
    VAE decode, with the old adapter."""
    return lambda: rollout(
        trainer.policy,
        ["stand-in prompt"],
        images_per_prompt=args.batch,
        steps=args.train_sampling_steps,
        resolution=shape.resolution,
        generator=torch.Generator().manual_seed(0),
        adapter="old",
        batch_size=args.batch,
        max_sequence_length=shape.text_tokens,
    )


def profile_rollout(run: Run, function: Callable[[], Any], warm_s: float, entry: dict) -> None:
    """One unprofiled and one profiled rollout call; they set the cost of profiling."""
    run.require("the unprofiled rollout call", SAFETY * warm_s)
    _, unprofiled_s = timed(run.device, function)
    entry["unprofiled_wall_ms"] = 1e3 * unprofiled_s
    run.require("the profiled rollout call", run.costs.profiled_call_s(unprofiled_s))
    measured = profile_calls(run.device, function, 1)
    entry["profile"] = with_idle(measured, entry["unprofiled_wall_ms"])
    run.costs = Costs(
        measured["profiled_wall_ms"] / entry["unprofiled_wall_ms"],
        measured["processing_s"] / unprofiled_s,
    )
    entry["profiling_cost"] = asdict(run.costs)


def profile_steps(
    run: Run, trainer: Trainer, step: list[TrainPiece], warm_s: float, entry: dict
) -> None:
    """One unprofiled optimizer step on the captured ``step``, then as many profiled
    steps (up to --steps) as the budget holds."""

    def optimizer_step() -> dict[str, Any]:
        return trainer.optimizer_step_on(step, torch.Generator().manual_seed(0))

    entry["sample_timesteps"] = sum(len(piece) * piece.data.timesteps for piece in step)
    run.require("the unprofiled step", SAFETY * warm_s)
    record, unprofiled_s = timed(run.device, optimizer_step)
    entry["unprofiled_wall_ms"] = 1e3 * unprofiled_s
    entry["step"] = {key: record.get(key) for key in (keys.SOLVED, keys.ENGINE, keys.SKIPPED)}
    if record.get(keys.SKIPPED):
        raise Skipped(f"the trainer skipped the captured step ({record[keys.SKIPPED]})")
    per_step_s = run.costs.profiled_call_s(unprofiled_s)
    fitting = int(min(run.args.steps, run.remaining_s() / per_step_s))
    if fitting < 1:
        run.require("one profiled step", per_step_s)  # raises: it does not fit
    if fitting < run.args.steps:
        entry["note"] = (
            f"{fitting} of the {run.args.steps} profiled steps asked for: each needs about "
            f"{per_step_s:.0f} s with post-processing, and the budget had no more"
        )
    entry["profile"] = with_idle(
        profile_calls(run.device, optimizer_step, fitting), entry["unprofiled_wall_ms"]
    )


def with_idle(measured: dict[str, Any], unprofiled_ms: float) -> dict[str, Any]:
    """The share of the wall time with no kernel running, unprofiled and profiled."""
    busy = measured.get("device_busy_ms")
    if busy is None:
        return measured
    return measured | {
        "idle_fraction": 1 - busy / unprofiled_ms,
        "idle_fraction_profiled": 1 - busy / measured["profiled_wall_ms"],
        "host_us_per_op": 1e3 * unprofiled_ms / measured["cpu_ops_per_call"],
    }


def warm_up(
    trainer: Trainer,
    timer: StepTimer,
    capture: StepCapture,
    strategy: Any,
    gradients: GradientEngine | None,
) -> tuple[dict[str, Any], list[TrainPiece]]:
    """One real epoch of the row (rollout, rewards, one optimizer step): first-call costs
    paid. Returns its figures and its step, captured for replay."""
    capture.step = None
    epoch = run_epoch(trainer, timer, strategy, gradients)
    if capture.step is None or not epoch["steps"]:
        raise RuntimeError("the warm-up epoch ran no optimizer step")
    first = epoch["steps"][0]
    figures = {
        "epoch_s": epoch["epoch_s"],
        "rollout_s": epoch["rollout_s"],
        "step_s": first["seconds"],
        "solved": first["solved"],
        "engine": first["engine"],
    }
    return figures, capture.step


def profile_everything(run: Run, bench: argparse.Namespace, shape: Shape, tmp: Path) -> None:
    """Build, warm up, then the rollout, the weighted-sum step and the MARBLE step."""
    device = run.device
    world = World(rank=0, size=1, device=device)
    built = run.stage("build", "model build", lambda _: build_trainer(bench, shape, world, tmp))
    if built is None:
        return
    trainer, strategies = built
    set_checkpointing(trainer, False)
    setup = describe_setup(trainer, bench, shape)
    unused = ("rounds", "repeats", "timesteps_per_sample")  # bench_gpu's own settings
    run.payload["setup"] = {k: v for k, v in setup.items() if k not in unused}
    dtype = getattr(torch, bench.dtype)
    run.payload["peak_matmul"] = run.stage(
        "peak", "matmul peak", lambda _: measure_matmul_peak(device, dtype, shape.matmul_size)
    )
    timer, capture = StepTimer(trainer), StepCapture(trainer)

    def warm_baseline(entry: dict[str, Any]) -> tuple[dict[str, Any], list[TrainPiece]]:
        figures, step = warm_up(trainer, timer, capture, strategies[BASELINE], None)
        entry |= figures
        return figures, step

    warm = run.stage("warm_up", "warm-up epoch (weighted sum)", warm_baseline)
    run.stage(
        "rollout",
        f"rollout: {bench.batch} images, {bench.train_sampling_steps} sampler steps + VAE decode",
        lambda entry: profile_rollout(
            run, sample(trainer, bench, shape), warm[0]["rollout_s"] if warm else 0.0, entry
        ),
    )

    def weighted_sum(entry: dict[str, Any]) -> None:
        if warm is None:
            raise Skipped("no captured step: the warm-up epoch did not finish")
        profile_steps(run, trainer, warm[1], warm[0]["step_s"], entry)

    run.stage("training_weighted_sum", "training step: weighted sum", weighted_sum)

    def marble(entry: dict[str, Any]) -> None:
        if warm is None:
            raise Skipped("the weighted-sum warm-up epoch did not finish")
        measured = run.payload["stages"]["training_weighted_sum"].get("unprofiled_wall_ms")
        step_s = warm[0]["step_s"] if measured is None else measured / 1e3
        warm_up_s = warm[0]["rollout_s"] + MARBLE_WARMUP_STEP * step_s
        solve_s = MARBLE_STEP * step_s
        run.require(
            "the row (warm-up epoch, one unprofiled and one profiled step)",
            SAFETY * (warm_up_s + solve_s) + run.costs.profiled_call_s(solve_s),
        )
        engine = GradientEngine(trainer.policy.transformer, trainer.parameters, "auto", dtype)
        entry["warm_up"], step = warm_up(trainer, timer, capture, strategies[MARBLE], engine)
        run.write()
        # The warm-up step also checked the per-row engine against K backward passes (once
        # per process): the unprofiled step needs about half its time.
        profile_steps(run, trainer, step, entry["warm_up"]["step_s"] / 2, entry)

    run.stage("training_marble", "training step: MARBLE every step, per-row engine", marble)


# -------------------------------------------------------------------- markdown
def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def render_markdown(payload: dict[str, Any]) -> str:
    """The report, from whatever the payload holds so far."""
    device = payload["device"]
    shape = payload["shape"]["name"]
    lines = [f"# Profile of one step: {shape} shape on {device['name']}", ""]
    if payload["smoke_run"]:
        lines += [
            f"> **{payload['smoke_label']}, not a result.** It checks that the script works; "
            "its figures say nothing about a GPU at the benchmark's shape.",
            "",
        ]
    if not payload["finished"]:
        lines += [
            f"> **Unfinished run.** Last written during `{payload['stage']}`: still running, "
            "or killed or crashed there. Below is what it had profiled by then.",
            "",
        ]
    problems = [
        f"{entry['label']}: {entry['status']}"
        for entry in payload["stages"].values()
        if entry["status"] not in ("ok", "running")
    ]
    if problems:
        lines += ["> **Failed or skipped stages**: " + "; ".join(problems) + ".", ""]
    lines += [*_setup_lines(payload), *_reading_lines(payload)]
    for entry in payload["stages"].values():
        if "profile" in entry:
            lines += _stage_lines(entry, device["type"] == "cuda")
    return "\n".join(lines)


def _setup_lines(payload: dict[str, Any]) -> list[str]:
    found = payload["versions"] or {"versions": payload["versions_error"]}
    versions_text = ", ".join(f"{k} {v}" for k, v in found.items())
    lines = [
        f"Device: {payload['device']['name']} ({payload['device']['type']}); {versions_text}; "
        f"git {payload['source']['git_head']}; {payload['date']}; "
        f"{payload['total_seconds']:.0f} s in all (budget {_num(payload['budget_s'])} s).",
        "",
    ]
    setup, peak = payload["setup"], payload["peak_matmul"]
    if setup is not None:
        lines += [
            f"Setup as `bench_gpu.py`'s weighted-sum row: `{setup['transformer_class']}` "
            f"({setup['transformer_parameters'] / 1e9:.3g} B parameters, random weights), "
            f"{setup['dtype']}, batch {setup['batch']}, {setup['train_sampling_steps']} "
            f"sampler steps, LoRA r={setup['lora']['rank']}, gradient checkpointing off, "
            "one optimizer step per epoch; K = 5 stand-in rewards, random text embeddings.",
            "",
        ]
    if peak is not None:
        lines += [
            f"Peak: {peak['tflops']:.4g} TFLOP/s ({peak['size']}^2 {peak['dtype']} matmul, "
            "same run).",
            "",
        ]
    warm = payload["stages"].get("warm_up", {})
    if "epoch_s" in warm:
        lines += [
            f"Warm-up epoch (first calls, not profiled): {_num(warm['epoch_s'])} s, of which "
            f"rollout {_num(warm['rollout_s'])} s and the optimizer step {_num(warm['step_s'])} s.",
            "",
        ]
    if payload["device"]["type"] == "cuda":
        lines += [
            "`torch.profiler` with CPU and CUDA activities, `record_shapes` and `with_flops`. "
            "An op's self device time is that of the kernels and copies it launched itself; "
            "GPU idle is 1 - (time with any kernel or copy running) / (wall time of the same "
            "call unprofiled, synchronized): the profiled wall is inflated by the profiler's "
            "cost per op.",
            "",
        ]
    return [
        *lines,
        "FLOPs are the profiler's count (GEMMs and convolutions, not attention). Optimizer: "
        "ops under torch's `Optimizer.*` annotations and `_foreach_` ops (AdamW, gradient "
        "clipping, EMA).",
        "",
    ]


def _reading_lines(payload: dict[str, Any]) -> list[str]:
    peak = (payload["peak_matmul"] or {}).get("tflops")
    on_device = payload["device"]["type"] == "cuda"
    lines = ["## Reading", ""]
    for entry in payload["stages"].values():
        if "profile" in entry:
            lines.append(f"- **{entry['label']}**: " + reading(entry, peak, on_device))
    if len(lines) == 2:
        lines.append("Nothing profiled yet.")
    return [*lines, ""]


def reading(entry: dict[str, Any], peak: float | None, on_device: bool) -> str:
    """A few sentences generated from one stage's figures: idle share, launch count,
    the largest categories and what the GEMMs achieve."""
    found = entry["profile"]
    unit = "rollout call" if entry["label"].startswith("rollout") else "optimizer step"
    wall = entry["unprofiled_wall_ms"]
    sentences = []
    if on_device:
        if not complete(found):
            sentences.append(
                "**Device records look incomplete** (launch calls without a kernel record, "
                "or device records that stop before the ops do: CUPTI dropped records), so "
                "the device times here are too low."
            )
        idle = found["idle_fraction"]
        verdict = (
            "host-bound: the GPU mostly waits for the CPU to launch work, so fewer and larger "
            "kernels (CUDA graphs, torch.compile, fused LoRA and elementwise ops) matter more "
            "than faster ones"
            if idle >= 0.5
            else "partly host-bound: for a large share of the time no kernel runs"
            if idle >= 0.2
            else "device-bound: kernels run back to back, the time is in the kernels"
        )
        sentences.append(
            f"kernels ran {_num(found['device_busy_ms'])} ms of the {_num(wall)} ms an "
            f"unprofiled {unit} takes (GPU idle {_pct(idle)}): {verdict}."
        )
        kernels = found["kernels_per_call"]
        sentences.append(
            f"{kernels:.0f} kernels per {unit}, {_num(found['mean_kernel_us'])} µs each on "
            f"average, while the host issues one every {_num(1e3 * wall / kernels)} µs of "
            f"unprofiled wall time ({found['cpu_ops_per_call']:.0f} host ops, one every "
            f"{_num(found['host_us_per_op'])} µs)."
        )
    else:
        sentences.append(
            f"self CPU time, {_num(found['total_self_ms'])} ms per {unit} profiled "
            f"({_num(wall)} ms unprofiled), {found['cpu_ops_per_call']:.0f} ops."
        )
    largest = [c for c in found["categories"] if c["percent"] >= 5][:3]
    shares = ", ".join(f"{c['category']} {c['percent']:.0f}%" for c in largest)
    sentences.append(f"Largest categories: {shares}.")
    gemm = next(c for c in found["categories"] if c["category"] == "matmul/GEMM")
    if gemm["tflops"] is not None and peak:
        efficiency, share = gemm["tflops"] / peak, gemm["self_ms"] / wall
        sentences.append(
            f"GEMMs run at {gemm['tflops']:.3g} TFLOP/s while they run ({_pct(efficiency)} of "
            f"the peak) and take {_pct(share)} of the unprofiled wall time: by themselves they "
            f"make ~{_pct(efficiency * share)} of peak over the {unit}."
        )
    return " ".join(sentences)


def complete(found: dict[str, Any]) -> bool:
    """Whether a GPU profile's device records look whole: under 1% of the launch calls
    without their kernel, and device records until 90% of the ops' window or later."""
    launches = found["kernel_launches_per_call"] * found["calls"]
    cover = found["device_records_cover"]
    missing = found["launches_without_kernel_record"] > 0.01 * launches
    return not missing and (cover is None or cover >= 0.9)


def _stage_lines(entry: dict[str, Any], on_device: bool) -> list[str]:
    found = entry["profile"]
    basis = "self device time" if on_device else "self CPU time"
    facts = [
        ["profiled calls", f"{found['calls']}"],
        ["wall per call, unprofiled (ms)", _num(entry["unprofiled_wall_ms"])],
        ["wall per call, profiled (ms)", _num(found["profiled_wall_ms"])],
        [f"{basis} per call (ms)", _num(found["total_self_ms"])],
    ]
    if on_device:
        facts += [
            ["device busy per call (ms)", _num(found["device_busy_ms"])],
            ["GPU idle, vs unprofiled wall", _pct(found["idle_fraction"])],
            ["GPU idle, vs profiled wall", _pct(found["idle_fraction_profiled"])],
            ["kernel launches per call", f"{found['kernel_launches_per_call']:.0f}"],
            [
                "kernels / copies per call",
                f"{found['kernels_per_call']:.0f} / {found['copies_per_call']:.0f}",
            ],
            ["mean kernel (µs)", _num(found["mean_kernel_us"])],
            ["launch calls without a kernel record", f"{found['launches_without_kernel_record']}"],
            ["device records cover the ops' window", _pct(found["device_records_cover"])],
        ]
    facts += [
        ["host ops per call", f"{found['cpu_ops_per_call']:.0f}"],
        ["post-processing (s)", _num(found["processing_s"])],
    ]
    if "step" in entry:
        step = entry["step"]
        engine = "one combined backward"
        if step["solved"]:
            engine = f"per-objective gradients, {ENGINES.get(step['engine'], step['engine'])}"
        facts[1:1] = [
            ["(sample, timestep) pairs per step", f"{entry['sample_timesteps']}"],
            ["the step ran", engine],
        ]
    lines = [f"## {entry['label']}", ""]
    if "note" in entry:
        lines += [f"Note: {entry['note']}.", ""]
    lines += [markdown_table(["quantity", "value"], facts), ""]
    categories = [
        [
            c["category"],
            _num(c["self_ms"]),
            f"{c['percent']:.1f}",
            f"{c['calls']:.0f}",
            _num(c["tflops"]),
        ]
        for c in found["categories"]
    ]
    header = ["category", f"{basis} ms / call", "%", "ops / call", "TFLOP/s while running"]
    lines += [markdown_table(header, categories), ""]
    top = [
        [
            str(rank),
            f"`{op['name']}`",
            op["category"],
            f"{op['calls']:.0f}",
            _num(op["self_ms"]),
            f"{op['percent']:.1f}",
            _num(op["gflops"]),
        ]
        for rank, op in enumerate(found["top_ops"], 1)
    ]
    header = ["#", "op", "category", "calls / call", f"{basis} ms / call", "%", "GFLOP / call"]
    lines += [f"Top {len(top)} ops by {basis}:", "", markdown_table(header, top), ""]
    return lines


# ------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="sd35m")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--out", type=Path, required=True, help="folder for the two files")
    parser.add_argument("--steps", type=int, default=2, help="profiled optimizer steps per row")
    parser.add_argument("--budget", type=float, help="seconds for the whole run (default none)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the shape's tiny twin, batch 2, 2 sampler steps: a smoke run in seconds",
    )
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.quick:
        args.shape = SMALL_OF.get(args.shape, args.shape)
    if SHAPES[args.shape].real and args.device == "cpu":
        parser.error(
            f"--shape {args.shape} has the released model's sizes and needs a CUDA device; "
            "--quick runs its tiny twin"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench = bench_arguments(
        [f"--shape={args.shape}", f"--device={args.device}", "--checkpointing=off", "--skip-ddp"]
        + (["--quick"] if args.quick else [])
    )
    device = torch.device(args.device)
    found_versions, version_error = None, None
    try:
        found_versions = versions()
    except ImportError as error:
        version_error = describe_error(error)
    payload: dict[str, Any] = {
        "benchmark": "profile_gpu_step",
        "smoke_run": device.type != "cuda" or args.quick,
        "smoke_label": "CPU smoke run" if device.type != "cuda" else "Quick smoke run",
        "finished": False,
        "stage": "starting",
        "budget_s": args.budget,
        "device": device_info(device),
        "versions": found_versions,
        "versions_error": version_error,
        "source": source_state(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "arguments": sys.argv[1:] if argv is None else argv,
        "shape": SHAPES[args.shape].describe(),
        "setup": None,
        "peak_matmul": None,
        "stages": {},
        "total_seconds": 0.0,
    }
    run = Run(args, args.out, payload)
    with tempfile.TemporaryDirectory(prefix="profile_gpu_step_") as tmp:
        profile_everything(run, bench, SHAPES[args.shape], Path(tmp))
    payload["finished"] = True
    run.log(f"done: wrote {run.json_path} and {run.md_path}")
    profiled = [entry for entry in payload["stages"].values() if "profile" in entry]
    return 0 if profiled else 1


if __name__ == "__main__":
    raise SystemExit(main())
