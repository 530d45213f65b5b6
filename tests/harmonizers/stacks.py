"""Gradient stacks and helpers that several harmonizer test files share."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from test_exactness_stress import NEAR_SINGULAR_KINDS, near_singular_stack, spread_stack

import mogradient
from mogradient.harmonizers import HARMONIZERS, Harmonizer, make_harmonizer

DTYPES = (torch.float32, torch.float64)


TORCHJD_EXAMPLE = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]], dtype=torch.float64)


finite_floats = st.floats(-10, 10, allow_nan=False, allow_infinity=False, width=64)


@st.composite
def jacobians(draw: st.DrawFn, max_objectives: int = 5) -> torch.Tensor:
    count = draw(st.integers(2, max_objectives))
    dim = draw(st.integers(1, 7))
    values = draw(arrays(np.float64, (count, dim), elements=finite_floats))
    jacobian = torch.from_numpy(values)
    # Keep every row usable: dropping is the base class's job and tested there.
    return jacobian[jacobian.norm(dim=1) > 1e-3]


def random_jacobian(seed: int, count: int, dim: int, spread: float = 0.0) -> torch.Tensor:
    """Gaussian rows with norms spread over 10^(+-spread)."""
    generator = torch.Generator().manual_seed(seed)
    jacobian = torch.randn(count, dim, generator=generator, dtype=torch.float64)
    scales = 10 ** (spread * (2 * torch.rand(count, 1, generator=generator) - 1))
    return jacobian * scales.to(torch.float64)


def well_conditioned(jacobian: torch.Tensor) -> bool:
    """Full row rank with a moderate condition number: weights are then unique and stable."""
    singular = torch.linalg.svdvals(jacobian / jacobian.norm(dim=1, keepdim=True))
    return len(jacobian) <= jacobian.shape[1] and bool(singular.min() > 1e-3 * singular.max())


def build(name: str, **options: object) -> mogradient.Harmonizer:
    if HARMONIZERS[name].randomized:
        options.setdefault("seed", 0)
    return make_harmonizer(name, **options)


CROSS_CHECK_SHAPES = [(2, 3, 0), (3, 5, 1), (4, 4, 0), (5, 9, 2), (6, 10, 1)]


U = float(np.finfo(np.float64).eps) / 2


STEPS = 6


def random_stacks(seed: int, count: int, dim: int, steps: int = STEPS) -> list[torch.Tensor]:
    """Consecutive steps' stacks: a fixed Gaussian stack plus fresh noise each step."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((count, dim))
    return [torch.from_numpy(base + 0.5 * rng.standard_normal((count, dim))) for _ in range(steps)]


def example_stacks(steps: int = STEPS) -> list[torch.Tensor]:
    """TorchJD's example, its rows rescaled differently each step (so ExcessMTL moves)."""
    return [
        TORCHJD_EXAMPLE * torch.tensor([[1.0 + 0.3 * t], [1.0 / (1.0 + 0.1 * t)]])
        for t in range(steps)
    ]


STACK_FAMILIES = {
    "torchjd_example": example_stacks(),
    **{
        f"random_K{count}_D{dim}": random_stacks(seed, count, dim)
        for seed, (count, dim) in enumerate([(3, 10), (4, 25), (5, 50)])
    },
}


def run(harmonizer: Harmonizer, stacks: list[torch.Tensor]) -> np.ndarray:
    return np.stack([harmonizer(stack).weights.numpy() for stack in stacks])


def simplex_projection(point: np.ndarray) -> np.ndarray:
    """argmin ||x - point|| over the simplex: max(point - tau, 0) with tau found by bisection
    on the decreasing sum(max(point - tau, 0)) = 1 (to the last bit)."""
    low, high = point.min() - 1.0, point.max()
    for _ in range(2000):
        middle = 0.5 * (low + high)
        if middle in (low, high):
            break
        if np.maximum(point - middle, 0.0).sum() > 1.0:
            low = middle
        else:
            high = middle
    projected = np.maximum(point - high, 0.0)
    return projected / projected.sum()


U32 = 2.0**-24


RANDOM_SHAPES = ((3, 10), (4, 25), (5, 50), (5, 10))


SPREADS = (0.0, 4.0, 8.0)  # norms over 10^-e .. 10^e


def random_stack(seed: int, count: int, dim: int) -> torch.Tensor:
    return torch.randn(
        count, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )


def parity_stacks(min_count: int = 2) -> list[torch.Tensor]:
    stacks = [random_stack(seed, *shape) for seed, shape in enumerate(RANDOM_SHAPES)]
    return [stack for stack in [TORCHJD_EXAMPLE, *stacks] if len(stack) >= min_count]


def stress_stacks() -> list[tuple[str, torch.Tensor]]:
    stacks = [
        (f"spread-1e{exponent:g}-K{count}", spread_stack(seed, count, 12, (-exponent, exponent)))
        for seed, count in enumerate((3, 5))
        for exponent in SPREADS
    ]
    stacks += [
        (f"{kind}-K{count}", near_singular_stack(kind, seed, count))
        for kind in NEAR_SINGULAR_KINDS
        for seed, count in enumerate((3, 5))
    ]
    return stacks


STRESS = stress_stacks()


STRESS_IDS = [name for name, _ in STRESS]


def relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours.double() - theirs.double()).norm() / ours.double().norm())


def unit_condition(stack: torch.Tensor) -> float:
    singular = torch.linalg.svdvals(stack / stack.norm(dim=1, keepdim=True))
    return float(singular[0] / singular[-1])


def float32_bound(stack: torch.Tensor, power: int = 1) -> float:
    return 2 * stack.shape[1] * U32 * unit_condition(stack) ** power


def graddrop_reference(
    stack: np.ndarray, draws: np.ndarray, leak: np.ndarray | None = None
) -> np.ndarray:
    """GradDrop coordinate by coordinate, with the uniform draws U given."""
    leak = np.zeros(len(stack)) if leak is None else leak
    total, size = stack.sum(axis=0), np.abs(stack).sum(axis=0)
    purity = 0.5 * (1 + np.divide(total, size, out=np.zeros_like(total), where=size > 0))
    mask = ((purity > draws) & (stack > 0)) | ((purity < draws) & (stack < 0))
    return ((leak[:, None] + (1 - leak[:, None]) * mask) * stack).sum(axis=0)


def draws_for(seed: int, dim: int) -> np.ndarray:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(dim, generator=generator, dtype=torch.float64).numpy()


CASES = 50


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
