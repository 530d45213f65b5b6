"""NashMTL, FairGrad, ConFIG and PCD at the edge of the input's precision.

A float32 stack is known to ~1e-7 relative, a float64 one to ~1e-16: two gradients at an
angle of 1e-8 from exact opposition are opposed within float32's precision, and weights
that cancel beyond it give a direction that is round-off. These tests hold each method to
its own promise, on stacks where zero lies in the gradients' hull, or the rows are
collinear, up to the rounding of the dtype they are given in:

* opposed pairs ``[x, -c x]`` (c in [0.1, 10], D = 50);
* stationary stacks: K = 20 > D = 10 rows shifted so that a positive combination is zero
  (then rounded to the dtype), and plain Gaussian 20 x 10 stacks, half of which have zero
  in their hull (Wendel's theorem);
* collinear stacks: rows ``c_k x`` with random signs and scales, computed in the dtype.

What is checked (facts about the result, not the code's own arithmetic), with
eps = ``torch.finfo(dtype).eps`` and r = sum_k |w_k| ||g_k|| / ||d|| the weights'
cancellation ratio (d formed from w in precision eps is off by ~K eps r ||d||):

* a fallback says why, with the documented weights (zero, or the primary for PCD's
  ``infeasible``);
* otherwise r <= 1 / sqrt(eps): weights no larger than the stack's scale warrants, in
  that the direction keeps at least half the dtype's digits (eps r <= sqrt(eps));
* no protected gradient conflicts with d beyond that round-off:
  g_k . d >= -K eps r ||g_k|| ||d|| (every gradient; PCD's secondaries only: PCD protects
  them, and may turn against the primary);
* on collinear stacks d is parallel to x (every combination of the rows is), up to
  that round-off and this test's own (D eps).

Also: ``kkt_residual`` bounds the promise's violation measured on the returned float32
direction (a conflicting answer never reports round-off); ConFIG is permutation
invariant and positively homogeneous; and the issue's four examples, by name. Each test
function fails on the code before the precision fix (checked: 44 of these 72 cases).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch

from mogradient.harmonizers.base import Harmonization, Harmonizer
from mogradient.harmonizers.config_grad import ConFIG
from mogradient.harmonizers.fairgrad import FairGrad
from mogradient.harmonizers.nash_mtl import NashMTL
from mogradient.harmonizers.pcd import PCD

DTYPES = (torch.float32, torch.float64)
CASES = 50
METHODS: dict[str, Callable[[], Harmonizer]] = {
    "nashmtl": NashMTL,
    "fairgrad-0.5": lambda: FairGrad(0.5),
    "fairgrad-1": lambda: FairGrad(1.0),
    "fairgrad-2": lambda: FairGrad(2.0),
    "config": ConFIG,
    "pcd": PCD,
}
ZERO_FALLBACKS = {"pareto_stationary", "no_common_direction", "zero_direction"}


def opposed_pair(seed: int, dtype: torch.dtype) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.standard_normal(50)).to(dtype)
    return torch.stack([x, -float(rng.uniform(0.1, 10.0)) * x])


def stationary_stack(seed: int, dtype: torch.dtype) -> torch.Tensor:
    """20 x 10 rows with sum_k a_k g_k = 0 for random a_k > 0 (before rounding to dtype)."""
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((20, 10))
    shares = rng.uniform(0.5, 1.5, 20)
    rows -= (shares @ rows) / shares.sum()
    return torch.from_numpy(rows).to(dtype)


def overdetermined_stack(seed: int, dtype: torch.dtype) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.standard_normal((20, 10))).to(dtype)


def collinear_stack(seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows c_k x, |c_k| in [0.1, 10] and random signs, multiplied in the dtype."""
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.standard_normal(50)).to(dtype)
    count = int(rng.integers(2, 7))
    factors = rng.choice([-1.0, 1.0], count) * 10.0 ** rng.uniform(-1.0, 1.0, count)
    return torch.stack([float(factor) * x for factor in factors])


def well_posed_stack(seed: int, dtype: torch.dtype) -> torch.Tensor:
    """2..5 Gaussian rows in 20 dimensions: no method should fall back here."""
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.standard_normal((int(rng.integers(2, 6)), 20))).to(dtype)


FAMILIES: dict[str, Callable[[int, torch.dtype], torch.Tensor]] = {
    "opposed": opposed_pair,
    "stationary": stationary_stack,
    "overdetermined": overdetermined_stack,
    "collinear": collinear_stack,
}


def cancellation(result: Harmonization, stack: torch.Tensor) -> float:
    """r = sum_k |w_k| ||g_k|| / ||d|| (at least 1 for d = sum_k w_k g_k)."""
    norms = stack.double().norm(dim=1)
    return float(result.weights.abs() @ norms) / float(result.direction.double().norm())


def assert_honest(name: str, result: Harmonization, stack: torch.Tensor) -> None:
    """The checks of the module docstring."""
    eps = torch.finfo(stack.dtype).eps
    assert torch.isfinite(result.weights).all() and torch.isfinite(result.direction).all()
    if result.fallback in ZERO_FALLBACKS:
        assert not result.weights.any() and not result.direction.any(), result.fallback
        return
    if result.fallback == "infeasible":
        assert name == "pcd" and result.weights.tolist() == [1.0] + [0.0] * (len(stack) - 1)
        return
    assert result.fallback is None, result.fallback
    ratio = cancellation(result, stack)
    assert ratio <= 1 / math.sqrt(eps), f"weights cancel by {ratio:.3g}"
    values, direction = stack.double(), result.direction.double()
    protected = values[1:] if name == "pcd" else values
    cosines = (protected @ direction) / (protected.norm(dim=1) * direction.norm())
    round_off = len(stack) * eps * max(ratio, 1.0)
    assert float(cosines.min()) >= -round_off, f"cosine {float(cosines.min()):.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", METHODS)
def test_no_conflict_without_a_fallback_and_no_runaway_weights(
    name: str, family: str, dtype: torch.dtype
) -> None:
    for seed in range(CASES):
        stack = FAMILIES[family](seed, dtype)
        result = METHODS[name]()(stack)
        assert_honest(name, result, stack)
        if family == "collinear" and result.direction.any():
            line = stack[0].double() / stack[0].double().norm()
            direction = result.direction.double()
            off_line = direction - (direction @ line) * line
            # Forming d (K eps r) plus this test's own D-term projection (D eps).
            ratio = max(cancellation(result, stack), 1.0)
            bound = (len(stack) * ratio + stack.shape[1]) * torch.finfo(dtype).eps
            assert float(off_line.norm() / direction.norm()) <= bound


def promise_violation(name: str, result: Harmonization, stack: torch.Tensor) -> float:
    """How far the returned direction misses the method's promise, measured in float64.

    Nash-MTL (max_norm=0): g_k . d = 1 / w_k. FairGrad: g_k . d = w_k^(-1/alpha). Both
    relative to the promised value. ConFIG: one cosine c_k for every gradient, as
    (max c - min c) / (2 max c) (at most r when u_k . t is within r of 1). PCD: the fresh
    instance's constraint u_j . d~ >= tau a_j, a_j = ||g_j|| / sqrt(||g_j||^2 + 1e-8),
    d~ = d ||d~|| / ||g_1||, relative to ||d~|| + max b.
    """
    values, direction = stack.double(), result.direction.double()
    norms = values.norm(dim=1)
    products = values @ direction
    if name.startswith("fairgrad"):
        promised = result.weights ** (-1.0 / float(name.split("-")[1]))
        return float(((products - promised).abs() / promised).max())
    if name == "nashmtl":
        return float((products * result.weights - 1.0).abs().max())
    if name == "config":
        cosines = products / (norms * direction.norm())
        return float((cosines.max() - cosines.min()) / (2 * cosines.max()))
    unscaled = direction * result.extras["unscaled_norm"] / norms[0]
    bounds = 0.02 * norms[1:] / torch.sqrt(norms[1:] ** 2 + 1e-8)
    shortfall = (bounds - (values[1:] / norms[1:, None]) @ unscaled).clamp_min(0.0)
    return float(shortfall.max() / (unscaled.norm() + bounds.max()))


@pytest.mark.parametrize(
    "name", ["nashmtl", "fairgrad-0.5", "fairgrad-1", "fairgrad-2", "config", "pcd"]
)
def test_kkt_residual_bounds_the_promise_on_float32_stacks(name: str) -> None:
    """The issue's FairGrad answer conflicted with 11 of 20 gradients at kkt_residual 1.7e-14.
    Products of float32 entries are exact in float64, so the promise can be measured on the
    direction returned; kkt_residual must bound what is measured, up to the K-term sum that
    formed d (a factor K: the residual counts eps per gradient)."""
    make_harmonizer = (lambda: NashMTL(max_norm=0.0)) if name == "nashmtl" else METHODS[name]
    for make in [*FAMILIES.values(), well_posed_stack]:
        for seed in range(CASES // 2):
            stack = make(seed, torch.float32)
            result = make_harmonizer()(stack)
            if result.fallback is None:
                violation = promise_violation(name, result, stack)
                assert violation <= len(stack) * result.kkt_residual, (violation, result)


@pytest.mark.parametrize("name", ["nashmtl", "fairgrad-0.5", "fairgrad-1", "fairgrad-2"])
def test_opposed_float32_pair_is_pareto_stationary(name: str) -> None:
    """The issue's example: NashMTL gave weights [1.58e7, 1.22e7] and d = -x."""
    x = torch.tensor([1.0, 2.0, 2.0])
    result = METHODS[name]()(torch.stack([x, -1.3 * x]))
    assert result.fallback == "pareto_stationary"
    assert not result.weights.any() and not result.direction.any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_config_exactly_opposed_unequal_norms_has_no_common_direction(dtype: torch.dtype) -> None:
    """The issue's example: [[1, 0], [-2, 0]] gave d = [-1, 0] and kkt_residual 1."""
    stack = torch.tensor([[1.0, 0.0], [-2.0, 0.0]], dtype=dtype)
    for rows in (stack, stack.flip(0), 3.7 * stack):
        result = ConFIG()(rows)
        assert result.fallback == "no_common_direction"
        assert not result.weights.any() and not result.direction.any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", [*FAMILIES, "well_posed"])
def test_config_is_permutation_invariant_and_positively_homogeneous(
    family: str, dtype: torch.dtype
) -> None:
    """ConFIG(P J) = ConFIG(J) and ConFIG(c J) = c ConFIG(J) for c > 0 (TorchJD's ConFIG keeps
    both). Rounding c J to the dtype moves a well-posed direction by ~eps times the unit
    rows' condition number (measured: 2e-7 in float32, 2e-15 in float64); a direction
    picked by round-off, a sign flip or a spurious fallback moves it by O(1). We allow
    sqrt(eps) of the directions' own length."""
    make = FAMILIES.get(family, well_posed_stack)
    tolerance = math.sqrt(torch.finfo(dtype).eps)
    for seed in range(CASES // 2):
        stack = make(seed, dtype)
        rng = np.random.default_rng(1000 + seed)
        order = torch.from_numpy(rng.permutation(len(stack)))
        factor = float(10.0 ** rng.uniform(-2.0, 2.0))
        base = ConFIG()(stack)
        for rows, multiple in ((stack[order], 1.0), (factor * stack, factor)):
            other = ConFIG()(rows)
            assert other.fallback == base.fallback
            ours, expected = other.direction.double(), multiple * base.direction.double()
            size = max(float(ours.norm()), float(expected.norm()))
            assert float((ours - expected).norm()) <= tolerance * size


@pytest.mark.parametrize("tau", [0.02, 0.0])
def test_pcd_collinear_float32_is_infeasible_or_zero(tau: float) -> None:
    """The issue's example: rows c_k x (float32) with secondaries of both signs gave the
    primary rotated by 90 degrees. Exactly collinear, the constraints u_j . d >= tau a_j
    cannot all hold for tau > 0 (``infeasible``: the primary); for tau = 0 they force
    d ⟂ x, and the closest such d to g_1 is zero (``zero_direction``)."""
    for seed in range(CASES):
        rng = np.random.default_rng(seed)
        x = torch.from_numpy(rng.standard_normal(50)).float()
        scales = 10.0 ** rng.uniform(-1.0, 1.0, 4)
        signs = np.array([1.0, 1.0, -1.0, rng.choice([-1.0, 1.0])])
        stack = torch.stack([float(s) * x for s in signs * scales])
        result = PCD(tau=tau)(stack)
        if tau > 0:
            assert result.fallback == "infeasible"
            torch.testing.assert_close(result.direction, stack[0], rtol=0, atol=0)
        else:
            assert result.fallback == "zero_direction"
            assert not result.direction.any()
