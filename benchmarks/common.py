"""Shared helpers for the benchmark scripts: machine info, timing, result files.

Kept separate so both scripts report the machine the same way; a number without the
machine it was measured on cannot be compared with anything.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine_info() -> dict[str, Any]:
    """CPU model, cores, RAM and library versions: what a timing depends on."""
    return {
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "ram_gib": round(_total_ram_bytes() / 2**30, 1),
        "python": platform.python_version(),
        "versions": {name: _version(name) for name in ("torch", "numpy", "torchjd", "cvxpy")},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "loadavg_1_5_15_end": os.getloadavg(),
    }


def machine_markdown(info: dict[str, Any]) -> str:
    """One paragraph with the machine description for the top of a result file."""
    versions = ", ".join(f"{name} {version}" for name, version in info["versions"].items())
    loads = [
        f"{when} {' / '.join(f'{value:.2f}' for value in info[key])}"
        for when, key in (("start", "loadavg_1_5_15_start"), ("end", "loadavg_1_5_15_end"))
        if key in info
    ]
    return (
        f"Machine: {info['cpu_model']}, {info['cpu_cores']} cores "
        f"(torch threads {info['torch_threads']}), {info['ram_gib']} GiB RAM; "
        f"Python {info['python']}, {versions}; run at {info['date']}. "
        f"Load average (1/5/15 min) at {'; at '.join(loads)}: other jobs shared the machine "
        "whenever these exceed ~0.1."
    )


def interleaved_times(
    functions: dict[str, Callable[[], Any]], repeats: int
) -> dict[str, dict[str, list[float]]]:
    """Wall and process-CPU seconds; each round runs every function once, in a rotated order.

    Interleaving makes slow drifts of the machine (other jobs, thermal state) hit every
    function alike instead of biasing whichever ran last. CPU time (all threads of this
    process) is kept too: it barely moves when other jobs compete for the cores.
    """
    names = list(functions)
    times: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in names}
    for round_index in range(repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            wall, cpu = time.perf_counter(), time.process_time()
            functions[name]()
            times[name]["cpu"].append(time.process_time() - cpu)
            times[name]["wall"].append(time.perf_counter() - wall)
    return times


def timing_summary(samples: dict[str, list[float]]) -> dict[str, Any]:
    """Medians (ms) of wall and CPU time, the fastest wall time, and the raw samples (ms).

    On a shared machine the fastest round is the one least interrupted by other jobs.
    """
    return {
        "median_ms": 1000.0 * statistics.median(samples["wall"]),
        "min_ms": 1000.0 * min(samples["wall"]),
        "cpu_median_ms": 1000.0 * statistics.median(samples["cpu"]),
        "times_ms": [1000.0 * sample for sample in samples["wall"]],
        "cpu_times_ms": [1000.0 * sample for sample in samples["cpu"]],
    }


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def write_results(
    name: str, payload: dict[str, Any], markdown: str, directory: Path | None = None
) -> tuple[Path, Path]:
    """Write <directory>/<name>.json and .md (default benchmarks/results); return both paths."""
    directory = RESULTS_DIR if directory is None else Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    json_path = directory / f"{name}.json"
    md_path = directory / f"{name}.md"
    json_path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    md_path.write_text(markdown.rstrip() + "\n")
    return json_path, md_path


def publish(
    name: str, payload: dict[str, Any], markdown: str, out: Path | None, quick: bool
) -> None:
    """Print the markdown; write the results (to ``out``, else benchmarks/results) unless
    this is a ``--quick`` smoke run without ``--out``: a smoke run never replaces results."""
    print(markdown)
    if out is not None or not quick:
        json_path, md_path = write_results(name, payload, markdown, out)
        print(f"wrote {json_path} and {md_path}")


def status_kib(field: str) -> int:
    """A memory field of /proc/self/status (``VmRSS``, ``VmHWM``), in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


# For a child process that measures peak memory: one thread, and glibc returning freed
# blocks of 64 KiB and more (mmap'ed, one arena, no trim threshold), so the high-water
# mark follows what is alive rather than what the allocator keeps.
MEASURING_CHILD_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "MALLOC_MMAP_THRESHOLD_": "65536",
    "MALLOC_TRIM_THRESHOLD_": "0",
    "MALLOC_ARENA_MAX": "1",
}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _total_ram_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Tensors and parameters created in the block default to ``dtype``: LibMTL builds its
    buffers in the default dtype (float64 keeps them exact), and a 20 B model initialised
    in float32 first would not fit an 80 GB GPU on its way to bf16."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
