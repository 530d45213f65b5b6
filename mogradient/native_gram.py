"""A compiled float32 Gram kernel, built from ``gram_kernel.c`` at first use.

Why: for a 5 x 2e7 float32 stack, torch's batched matmul (MKL) takes ~2.5x the time of
reading the stack once on a 2-core AMD EPYC; this loop takes ~1.5x, which is most of
what keeps MGDA near its floor of two reads. The kernel needs a C compiler (``$CC``,
Python's, or ``cc``); the library is cached per source, compiler and CPU, so a machine
compiles once. Without a compiler, or with ``MOGRADIENT_NATIVE=0``, ``float32_gram``
returns None and callers use torch. Columns are split into ``torch.get_num_threads()``
parts run on OpenMP threads: torch's own pool where torch uses GNU OpenMP (see the C
source), so torch's thread setting governs this too.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path

import numpy as np
import torch

_SOURCE = Path(__file__).with_name("gram_kernel.c")
_FLAG_SETS = (
    ("-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-fPIC", "-shared"),
    ("-O3", "-fopenmp", "-ffp-contract=fast", "-fPIC", "-shared"),
    ("-O3", "-ffp-contract=fast", "-fPIC", "-shared"),
)
# Columns per chunk keep the K rows' chunk in a 24 KiB share of L1 (at least 256 columns).
_L1_BYTES = 24 * 1024
_MIN_CHUNK = 256
# Below this many entries one thread is faster than waking the others.
_PARALLEL_ENTRIES = 1 << 20
_ALIGN = 32
_log = logging.getLogger(__name__)


def float32_gram(jacobian: torch.Tensor) -> torch.Tensor | None:
    """``J @ J.T`` in float64 (symmetric) from float32 pair sums, or None if not applicable.

    Applies to CPU float32 stacks whose rows are contiguous (any row stride) and that are
    not being differentiated. Each entry is accurate to ~(chunk / 32 + 3) float32 roundings
    of ``sum_c |a_c b_c|`` over a chunk, i.e. ~41 u for K = 5 (1216 columns; u = 2^-24).
    """
    if not _applicable(jacobian):
        return None
    library = _library()
    if library is None:
        return None
    num_objectives, dim = jacobian.shape
    chunk = max(_MIN_CHUNK, _L1_BYTES // (4 * num_objectives) // _ALIGN * _ALIGN)
    parts = max(1, torch.get_num_threads()) if jacobian.numel() >= _PARALLEL_ENTRIES else 1
    partials = np.zeros((parts, num_objectives, num_objectives), dtype=np.float64)
    library.gram_float32(
        jacobian.data_ptr(),
        num_objectives,
        jacobian.stride(0),
        dim,
        chunk,
        parts,
        partials.ctypes.data,
    )
    upper = partials.sum(axis=0)
    return torch.from_numpy(np.triu(upper) + np.triu(upper, 1).T)


def available() -> bool:
    """Whether the compiled kernel is in use (a compiler was found and the build worked)."""
    return _library() is not None


def _applicable(jacobian: torch.Tensor) -> bool:
    return (
        jacobian.ndim == 2
        and jacobian.dtype == torch.float32
        and jacobian.device.type == "cpu"
        and jacobian.shape[0] > 0
        and jacobian.shape[1] > 0
        and (jacobian.stride(1) == 1 or jacobian.shape[1] == 1)
        and not (jacobian.requires_grad and torch.is_grad_enabled())
    )


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("MOGRADIENT_NATIVE", "1") == "0":
        return None
    compiler = _compiler()
    if compiler is None:
        _log.info("no C compiler found: the Gram matrix uses torch's matmul")
        return None
    for flags in _FLAG_SETS:
        path = _cache_dir() / f"gram_kernel_{_build_key(compiler, flags)}.so"
        if path.exists() or _compile(compiler, flags, path):
            library = ctypes.CDLL(str(path))
            library.gram_float32.restype = None
            library.gram_float32.argtypes = (
                [ctypes.c_void_p] + [ctypes.c_int64] * 5 + [ctypes.c_void_p]
            )
            return library
    return None


def _compiler() -> str | None:
    configured = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "").split()
    for candidate in [*configured[:1], "cc", "gcc", "clang"]:
        found = shutil.which(candidate)
        if found:
            return found
    return None


def _cache_dir() -> Path:
    base = os.environ.get("MOGRADIENT_CACHE_DIR") or os.environ.get("XDG_CACHE_HOME")
    directory = Path(base) / "mogradient" if base else Path.home() / ".cache" / "mogradient"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        return directory
    except OSError:
        fallback = Path(tempfile.gettempdir()) / f"mogradient-{os.getuid()}"
        fallback.mkdir(parents=True, exist_ok=True)
        return fallback


def _build_key(compiler: str, flags: tuple[str, ...]) -> str:
    """Source, compiler, flags and CPU: ``-march=native`` code is only valid on its CPU."""
    digest = hashlib.sha256(_SOURCE.read_bytes())
    for part in (compiler, *flags, platform.machine(), _cpu_features()):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:16]


def _cpu_features() -> str:
    """The first processor's model and feature flags (Linux), else the platform's name."""
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(line for line in first if line.startswith(("model name", "flags", "Features")))


def _compile(compiler: str, flags: tuple[str, ...], path: Path) -> bool:
    """Build into a temporary file and rename it into place (atomic for parallel builds)."""
    handle, temporary = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(handle)
    try:
        result = subprocess.run(
            [compiler, *flags, str(_SOURCE), "-o", temporary],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if result.returncode != 0:
            _log.info("building the Gram kernel with %s failed:\n%s", flags, result.stderr)
            return False
        os.replace(temporary, path)
        return True
    except (OSError, subprocess.SubprocessError) as error:
        _log.info("building the Gram kernel failed: %s", error)
        return False
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
