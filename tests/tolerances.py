"""Tolerances for float results that may differ by rounding only: derived, not habitual.

The same computation along two paths (a batch split into chunks, another thread count,
a vmapped vs a looped backward, another CPU) can differ in the order of its
floating-point additions: MKL and oneDNN pick GEMM and convolution kernels by problem
size and by CPU (MKL's AVX-512 path on Intel, its AVX2 path on AMD), so a 2-row matmul
need not round like the same rows inside a 6-row one. Nothing is wrong, yet results
differ by rounding errors, and a bound of 1e-6 that holds on one machine fails on another.

* One reduction of ``n`` terms in any order is within ``gamma_n * sum |x_i|`` of the
  exact sum, ``gamma_n = n u / (1 - n u)``, ``u = eps / 2`` (Higham, *Accuracy and
  Stability of Numerical Algorithms*, 2002, eq. 3.4); two orders differ by at most twice
  that: :func:`reduction_atol`.
* A chain of such operations (a network, a sampler) rounds differently at every layer,
  and the rest of the chain carries each difference to the output. Per-layer bounds
  compounded through a network are far too loose, so the budget is counted in ulps of
  the result's scale and each call site says how it counts them (layers, steps, the
  gain of what follows): :func:`chain_atol`.

A bug (a wrong row, shared noise, a dropped term) changes results by O(1) relative to
their scale, orders of magnitude above these bounds.
"""

from __future__ import annotations

import torch


def eps(dtype: torch.dtype) -> float:
    """Machine epsilon: the spacing of floats at 1 (one ulp of a number of size 1)."""
    return torch.finfo(dtype).eps


def reduction_atol(dtype: torch.dtype, length: int, abs_sum: float) -> float:
    """Most two summation orders of ``length`` terms with ``sum |x_i| = abs_sum`` can differ."""
    u = eps(dtype) / 2
    if length * u >= 1:
        raise ValueError(f"a reduction of {length} terms has no rounding bound in {dtype}")
    return 2 * length * u / (1 - length * u) * abs_sum


def chain_atol(dtype: torch.dtype, scale: float, ulps: float) -> float:
    """``ulps`` rounding errors of a result of size ``scale``; the call site derives ``ulps``."""
    return ulps * eps(dtype) * float(scale)
