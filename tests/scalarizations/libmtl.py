"""Driving LibMTL 1.1.5's own weightings beside ours, step by step (the parity tests in
test_uw.py, test_dwa.py, test_gls.py, test_grad_norm.py and test_imtl.py).

Each parity test builds two copies of one seeded model (a Linear + tanh trunk, one linear
head per task, MSE losses on targets of scales 1, 3 and 10, a fresh batch every step), runs
LibMTL's ``backward`` on one copy (bound by the benchmark's LibMTL driver, as in the MTL
head-to-head) and ours on the other, and compares at every step what each produced: the
task weights, the gradients on the shared parameters, on the heads and on the learned
scales. Both copies then take the same SGD step; where the methods agree they evolve
independently, so any drift would show. In float64 LibMTL runs under a float64 default
dtype (its gradient buffers are ``torch.zeros`` of the default dtype). Differences by
design are asserted as such, rather than hidden, in each method's test.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tolerances import chain_atol

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # benchmarks/ is not installed; `python -m pytest` adds it too
    sys.path.insert(0, str(ROOT))

from benchmarks.common import default_dtype  # noqa: E402
from benchmarks.mtl.methods import LibMTL, libmtl_installed  # noqa: E402
from benchmarks.mtl.parity_model import TASKS, Model, batches  # noqa: E402

__all__ = [
    "DTYPES",
    "LR",
    "STEPS",
    "TASKS",
    "ULPS_PER_STEP",
    "Model",
    "batches",
    "check",
    "flat",
    "heads",
    "libmtl",
    "needs_libmtl",
    "recorded",
    "run_libmtl",
]

needs_libmtl = pytest.mark.skipif(
    not libmtl_installed(),
    reason="LibMTL is not installed (make mtl installs LibMTL==1.1.5 with --no-deps)",
)

STEPS = 5
LR = 0.05
DTYPES = [torch.float64, torch.float32]
# The two sides evaluate the same formulas in other orders (per-loss backward vs our
# gradient engine, einsum vs matmul, float32 vs our float64 norms): a few ulps of the
# result's scale per operation, a few dozen operations deep. The copies evolve on their
# own (SGD on parameters each side computed), so the budget grows with the step count.
# A wrong formula, order or sign is off by O(1) of the scale.
ULPS_PER_STEP = 64


def libmtl(name: str, model: Model, dtype: torch.dtype, **options: float) -> LibMTL:
    driver = LibMTL(name, dict(options))
    with default_dtype(dtype):
        driver.bind(model)
    return driver


def run_libmtl(driver: LibMTL, model: Model, losses: torch.Tensor) -> torch.Tensor:
    with default_dtype(losses.dtype):
        return driver.backward(model, list(losses), None)


def flat(parameters: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([parameter.grad.reshape(-1) for parameter in parameters]).double()


def heads(model: Model) -> torch.Tensor:
    """K x (head size) gradients: head k's row is what loss k sent it."""
    return torch.stack([flat(list(head.parameters())) for head in model.heads])


def check(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, step: int, what: str
) -> None:
    """Equal up to the rounding budget at ``step``, in ulps of max(1, |expected|)."""
    actual = torch.as_tensor(actual, dtype=torch.float64).detach()
    expected = torch.as_tensor(expected, dtype=torch.float64).detach()
    scale = max(1.0, float(expected.abs().max()))
    difference = float((actual - expected).abs().max())
    atol = chain_atol(dtype, scale, ULPS_PER_STEP * (step + 1))
    assert difference <= atol, (what, step, difference, atol, actual, expected)


def recorded(into: list[torch.Tensor]) -> Callable[..., None]:
    """Tensor.backward that first keeps (a detached copy of) what it backpropagates."""
    backward = torch.Tensor.backward

    def record(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        into.append(tensor.detach().clone())
        backward(tensor, *args, **kwargs)

    return record
