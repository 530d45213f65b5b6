"""Helpers of ``benchmarks/gpu_lease.sh``: the environment report a lease writes first, and
the size of what a device call carries.

Why: a lent GPU machine is held for minutes, has no network and returns a few files. What
the benchmark ran on must be on record even when it never starts (``env``), and what travels
there must fit the lease's limit, which is better found out here than by a refused call
(``size``, run by ``make gpu-wheels``).

Run: ``python benchmarks/gpu_lease.py env [--wheels DIR]`` prints one ``name: value`` line
per fact, each on its own even where another query fails (standard library only at import:
it prints where torch does not import); ``python benchmarks/gpu_lease.py size [--carry
PATH ...] [--limit-mib 64]`` adds up the travelling files and exits 1 when they do not fit.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import re
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
LEASE_LIMIT_MIB = 64  # the working tree that travels, carried folders included
# The training path's packages, reported with where they are imported from: a carried
# wheel shows the lease's temporary target, not the image's site-packages.
PACKAGES = (
    "torch",
    "diffusers",
    "peft",
    "transformers",
    "accelerate",
    "safetensors",
    "tokenizers",
    "huggingface_hub",
    "numpy",
)


# --------------------------------------------------------------------------- env
def describe(label: str, query: Callable[[], Any]) -> str:
    """``label: value``, or the query's error in its place: one failure costs one line."""
    try:
        value = query()
    except Exception as error:
        value = f"unavailable ({type(error).__name__}: {str(error).strip()[:200]})"
    return f"{label}: {value}"


def wheel_distributions(wheels: Path | None) -> list[str]:
    """Distribution names of the wheels in ``wheels`` (``NAME-VERSION-...whl``)."""
    if wheels is None or not wheels.is_dir():
        return []
    return sorted(path.name.split("-", 1)[0] for path in wheels.glob("*.whl"))


def package_origin(name: str) -> str:
    """Installed version of distribution ``name`` and the file its module imports from."""
    version = importlib.metadata.version(name)
    module = re.sub(r"[-.]", "_", name).lower()
    spec = importlib.util.find_spec(module)
    return f"{version} ({spec.origin if spec else 'module not found'})"


def _torch() -> Any:
    """torch, imported on first use: its failure to import is one line of the report."""
    import torch

    return torch


def cuda_device() -> str:
    torch = _torch()
    if not torch.cuda.is_available():
        return "none"
    properties = torch.cuda.get_device_properties(0)
    return (
        f"{torch.cuda.device_count()} x {properties.name}, "
        f"{properties.total_memory / 2**30:.1f} GiB, "
        f"compute capability {properties.major}.{properties.minor}"
    )


# What torch says about its build, the device, the attention kernels and TF32.
TORCH_QUERIES: tuple[tuple[str, Callable[[], Any]], ...] = (
    ("torch CUDA build", lambda: _torch().version.cuda),
    ("cuDNN", lambda: _torch().backends.cudnn.version()),
    ("NCCL", lambda: ".".join(map(str, _torch().cuda.nccl.version()))),
    ("CUDA device", cuda_device),
    ("SDPA flash enabled", lambda: _torch().backends.cuda.flash_sdp_enabled()),
    ("SDPA mem_efficient enabled", lambda: _torch().backends.cuda.mem_efficient_sdp_enabled()),
    ("SDPA cudnn enabled", lambda: _torch().backends.cuda.cudnn_sdp_enabled()),
    ("SDPA math enabled", lambda: _torch().backends.cuda.math_sdp_enabled()),
    ("flash attention built", lambda: _torch().backends.cuda.is_flash_attention_available()),
    ("TF32 matmul allowed", lambda: _torch().backends.cuda.matmul.allow_tf32),
    ("TF32 cuDNN allowed", lambda: _torch().backends.cudnn.allow_tf32),
    ("float32 matmul precision", lambda: _torch().get_float32_matmul_precision()),
)


def environment_lines(wheels: Path | None) -> list[str]:
    """The report: interpreter, carried wheels, packages with their origin, torch's view."""
    carried = wheel_distributions(wheels)
    lines = [
        describe("python", lambda: f"{sys.version.split()[0]} ({sys.executable})"),
        describe("wheels carried", lambda: ", ".join(carried) or "none"),
    ]
    for name in dict.fromkeys([*PACKAGES, *carried]):
        lines.append(describe(name, lambda name=name: package_origin(name)))
    lines += [describe(label, query) for label, query in TORCH_QUERIES]
    return lines


# -------------------------------------------------------------------------- size
def git_files(*options: str) -> list[Path]:
    """Files ``git ls-files`` lists with ``options`` that exist in the working tree."""
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z", *options],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    paths = (REPO / name for name in listed.split("\0") if name)
    return [path for path in paths if path.is_file() or path.is_symlink()]


def files_under(path: Path) -> list[Path]:
    if path.is_file() or path.is_symlink():
        return [path]
    return [item for item in path.rglob("*") if item.is_file() or item.is_symlink()]


def total(paths: Iterable[Path]) -> tuple[int, int]:
    """(bytes, files); a link counts as itself: it travels as a link."""
    sizes = [path.lstat().st_size for path in paths]
    return sum(sizes), len(sizes)


def travelling_parts(carry: list[Path]) -> dict[str, tuple[int, int]]:
    """(bytes, files) per part of what a device call sends: tracked files, untracked ones
    git does not ignore, and each carried path."""
    parts = {
        "tracked": total(git_files()),
        "untracked": total(git_files("--others", "--exclude-standard")),
    }
    for path in carry:
        parts[str(path)] = total(files_under(REPO / path)) if (REPO / path).exists() else (0, 0)
    return parts


def size_report(parts: dict[str, tuple[int, int]], limit_mib: float) -> tuple[bool, str]:
    """Whether the parts fit the limit, and one line saying so with the figures."""
    mib = 2**20
    used = sum(size for size, _ in parts.values())
    figures = " + ".join(
        f"{name} {size / mib:.1f} MiB ({count} files)" for name, (size, count) in parts.items()
    )
    line = f"travels to the lease: {figures} = {used / mib:.1f} MiB of {limit_mib:g} MiB"
    if used <= limit_mib * mib:
        return True, f"{line}: fits, {limit_mib - used / mib:.1f} MiB to spare"
    excess = used / mib - limit_mib
    return False, f"{line}: TOO LARGE by {excess:.1f} MiB, the device call would be refused"


# -------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    commands = parser.add_subparsers(dest="command", required=True)
    env = commands.add_parser("env", help="print the environment report")
    env.add_argument("--wheels", type=Path, help="the carried wheels' folder, if any")
    size = commands.add_parser("size", help="check what a device call carries")
    size.add_argument("--carry", type=Path, nargs="*", default=[], help="carried paths")
    size.add_argument("--limit-mib", type=float, default=LEASE_LIMIT_MIB)
    args = parser.parse_args(argv)
    if args.command == "env":
        print("\n".join(environment_lines(args.wheels)), flush=True)
        return 0
    try:
        parts = travelling_parts(args.carry)
    except (OSError, subprocess.CalledProcessError) as error:
        print(f"cannot tell what travels: git ls-files failed in {REPO} ({error})")
        return 2
    fits, line = size_report(parts, args.limit_mib)
    print(line)
    return 0 if fits else 1


if __name__ == "__main__":
    raise SystemExit(main())
