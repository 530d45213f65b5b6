"""The MARBLE release's gradient balancer beside our MGDA: weights, direction, exactness, time.

The release (aim-uofa/MARBLE @1bf9543, ``flow_grpo/pareto_balancer``) balances K reward
gradients by MGDA on unit gradients, solved by SciPy's SLSQP; ours
(:class:`mogradient.harmonizers.MGDA`, normalize-and-rescale) solves the same QP exactly.
This tool holds its own implementation of the release's algorithm (:func:`release_balance`,
written from the description in the project's notes on the release, §2; dtypes checked
against the release's files; none of its code is copied) and runs both on the same stacks:

    .venv/bin/python tools/marble_release_parity.py            # full run, 1-4 min on 2 cores
    .venv/bin/python tools/marble_release_parity.py --quick --out /tmp/parity   # seconds

The full run writes benchmarks/results/marble_release_parity.{json,md}; ``--quick`` writes
only where ``--out`` says (and nothing without it): a smoke run never replaces results.

What is compared, per stack: the simplex weights alpha (max abs difference), the
directions (cosine), each one's optimality gap a^T C a - min over the feasible set, C the
unit-gradient Gram computed in float64 from the stack, against a reference solved
independently (the best of an enumeration of the QP's faces, cvxpy with Clarabel at
tolerances 1e-14, and quadprog), each one's KKT residual on C, and the time per call
(medians over interleaved repeats).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import inspect
import itertools
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy import optimize

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmarks/ is not installed; run as a script, it is not found
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    interleaved_times,
    machine_info,
    machine_markdown,
    markdown_table,
    timing_summary,
    write_results,
)
from mogradient._qp import simplex_kkt_residual  # noqa: E402
from mogradient.harmonizers import MGDA  # noqa: E402

NAME = "marble_release_parity"
# The release's settings (config/nft.py: grad_eps 1e-12; mgda.py: SLSQP options).
GRAD_EPS = 1e-12
SLSQP_FTOL = 1e-8
SLSQP_MAXITER = 500
FAILED_SUM = 1e-8  # a failed SLSQP iterate summing below this raises (-> solver_failed)

FAMILIES = ("gaussian", "conflicting", "near_duplicate", "opposed", "rank_deficient", "wide_scale")
COUNTS = (2, 3, 5, 8)
DTYPES = {"float32": torch.float32, "float64": torch.float64}
# A direction is "defined" when the exact min-norm point of the (weighted) unit gradients
# is this far from zero: ||d*|| >= 1e-3 of the mean norm. Below it, zero is in the hull to
# within a float32 Gram's error (~1e-7) and the direction is whatever the rounding leaves.
DEFINED_MIN_OBJECTIVE = 1e-6
REFERENCE_TOL = 1e-14  # Clarabel's gap and feasibility tolerances
QUADPROG_RIDGE = 1e-13  # quadprog needs a positive definite Hessian
ENUMERATION_MAX_K = 12
TIMING_REPEATS = 21  # D = 1e6; 2 shared cores make single timings noisy
# One thread, and torch's default (2 here): with other jobs on the 2 cores, a parallel
# region waits for its descheduled thread, which hits the release's many passes hardest.
TIMING_THREADS = (1, max(torch.get_num_threads(), 2))
# Families whose points can be affinely dependent: alpha is not unique there (the
# direction is), so alpha differences measure nothing.
DEPENDENT_FAMILIES = ("near_duplicate", "rank_deficient", "opposed")
COS_CLAIM = 0.99999


# ----------------------------------------------------------------------------- the release


@dataclass
class ReleaseBalance:
    """What the release's balancer returns, and what its solver saw."""

    direction: torch.Tensor
    alphas: torch.Tensor  # float32, one per objective, 0 for invalid ones
    raw_norms: torch.Tensor  # float32
    valid: torch.Tensor  # bool
    rescale: float
    reason: str  # "none", "all_zero", "single_valid" or "solver_failed"
    solver: dict[str, Any] = field(default_factory=dict)


def release_simplex_weights(
    units: Sequence[torch.Tensor], floor: float = 0.0, info: dict[str, Any] | None = None
) -> torch.Tensor:
    """The release's MGDA solve on (weighted) unit vectors: float32 weights summing to 1.

    Gram of the vectors cast to float32, by a float32 product, then float64; SLSQP on
    1/2 a^T G a from the uniform point, bounds a_k >= floor, sum a = 1 (ftol 1e-8, 500
    iterations). A negative floor counts as 0, floor K > 1 as 1/K. A run SLSQP reports
    as failed is still used, clipped to the floor, unless the clipped iterate sums below
    1e-8 (RuntimeError). The result is clipped to the floor, cast to float32 and divided
    by its float32 sum. ``info`` receives the Gram and SLSQP's status.
    """
    count = len(units)
    if count == 1:
        return torch.ones(1, dtype=torch.float32)
    rows32 = torch.stack([unit.reshape(-1).to(torch.float32) for unit in units])
    gram = (rows32 @ rows32.T).to(torch.float64).cpu().numpy()
    lower = max(float(floor), 0.0)
    if lower * count > 1.0:
        lower = 1.0 / count

    def half_norm_squared(weights: np.ndarray) -> float:
        return 0.5 * float(weights @ gram @ weights)

    def sum_is_one(weights: np.ndarray) -> float:
        return float(weights.sum()) - 1.0

    run = optimize.minimize(
        half_norm_squared,
        np.full(count, 1.0 / count),
        jac=lambda weights: gram @ weights,
        method="SLSQP",
        bounds=[(lower, None)] * count,
        constraints=[{"type": "eq", "fun": sum_is_one, "jac": lambda _: np.ones(count)}],
        options={"ftol": SLSQP_FTOL, "maxiter": SLSQP_MAXITER},
    )
    clipped = np.clip(np.asarray(run.x, dtype=np.float64), lower, None)
    if info is not None:
        info.update(
            gram=gram,
            floor=lower,
            success=bool(run.success),
            iterations=int(run.nit),
            message=str(run.message),
        )
    if not run.success and clipped.sum() < FAILED_SUM:
        raise RuntimeError(f"SLSQP failed and its iterate sums to {clipped.sum():.3g}")
    weights = torch.from_numpy(clipped).to(torch.float32)
    return weights / weights.sum().clamp_min(1e-12)


def release_balance(
    vectors: Sequence[torch.Tensor],
    reward_weights: Sequence[float] | None = None,
    alpha_floor: float = 0.0,
    *,
    eps: float = GRAD_EPS,
    solve: Callable[..., torch.Tensor] = release_simplex_weights,
) -> ReleaseBalance:
    """The release's balancer (normalize on): d = m sum_k alpha_k w_k u_k.

    Valid: finite and raw norm (taken in the vector's dtype, kept in float32) > ``eps``.
    u_k = g_k / max(||g_k||, eps), times ``reward_weights[k]`` when given; alpha from
    ``solve`` on the valid ones; m the float32 mean raw norm over the valid objectives.
    Fallbacks: none valid -> zero direction; one valid -> its raw gradient unchanged; a
    RuntimeError from ``solve`` -> the mean of the (weighted) unit vectors, times m.
    """
    if not vectors:
        raise ValueError("no gradient vectors")
    dtype = vectors[0].dtype
    finite = [bool(torch.isfinite(vector).all()) for vector in vectors]
    zero = torch.zeros((), dtype=torch.float32)
    norms = torch.stack(
        [
            vector.norm().to(torch.float32) if ok else zero
            for vector, ok in zip(vectors, finite, strict=True)
        ]
    )
    valid = torch.tensor(finite) & (norms > eps)
    alphas = torch.zeros(len(vectors), dtype=torch.float32)
    if not valid.any():
        return ReleaseBalance(torch.zeros_like(vectors[0]), alphas, norms, valid, 0.0, "all_zero")
    indices = torch.nonzero(valid).flatten().tolist()
    units = [vectors[index] / vectors[index].norm().clamp_min(eps) for index in indices]
    if reward_weights is not None:
        units = [
            float(reward_weights[index]) * unit for index, unit in zip(indices, units, strict=True)
        ]
    if len(indices) == 1:
        alphas[indices[0]] = 1.0
        only = vectors[indices[0]].clone()
        return ReleaseBalance(only, alphas, norms, valid, float(norms[indices[0]]), "single_valid")
    info: dict[str, Any] = {}
    try:
        solved = solve(units, alpha_floor, info)
        alphas[indices] = solved
        combined = torch.stack(
            [weight * unit for weight, unit in zip(solved, units, strict=True)]
        ).sum(0)
        reason = "none"
    except RuntimeError:
        combined = torch.stack(units).mean(0)
        alphas[valid] = 1.0 / len(indices)
        reason = "solver_failed"
    mean_norm = norms[valid].mean()  # float32
    direction = (combined * mean_norm).to(dtype)
    return ReleaseBalance(direction, alphas, norms, valid, float(mean_norm), reason, info)


# ----------------------------------------------------------------------------- the stacks


def make_stack(family: str, count: int, dim: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """K x D stack of one family, built in float64 and then cast to ``dtype``.

    gaussian: iid N(0, 1) rows. conflicting: g_k = s_k (b_0 + sum_j c_kj b_j + 0.1 n_k),
    c ~ N(0, 2^2) on max(1, K // 2) directions b_j (conflicts, some alphas 0), s_k =
    10^U(-1, 1). near_duplicate: rows 2i + 1 = row 2i + 1e-6 relative noise. opposed:
    row 1 = -c row 0 exactly (c ~ U(0.3, 3)), the others Gaussian (zero in the hull).
    rank_deficient: rank ceil(K / 2) (K = 2: two multiples of one vector). wide_scale:
    conflicting rows scaled to norms 1e-4 ... 1e4 (both ends present), shuffled.
    """
    rng = np.random.default_rng([FAMILIES.index(family), count, dim, seed])
    if family in ("gaussian", "near_duplicate", "opposed"):
        stack = rng.standard_normal((count, dim))
        if family == "near_duplicate":
            for index in range(1, count, 2):
                stack[index] = stack[index - 1] + 1e-6 * rng.standard_normal(dim)
        elif family == "opposed":
            stack[1] = -rng.uniform(0.3, 3.0) * stack[0]
    elif family == "rank_deficient":
        rank = (count + 1) // 2
        stack = rng.standard_normal((count, rank)) @ rng.standard_normal((rank, dim))
    elif family in ("conflicting", "wide_scale"):
        rank = max(1, count // 2)
        coefficients = np.hstack([np.ones((count, 1)), 2.0 * rng.standard_normal((count, rank))])
        basis = rng.standard_normal((rank + 1, dim))
        stack = coefficients @ basis + 0.1 * rng.standard_normal((count, dim))
        stack /= np.linalg.norm(stack, axis=1, keepdims=True)
        if family == "conflicting":
            stack *= 10.0 ** rng.uniform(-1.0, 1.0, (count, 1))
        else:
            exponents = np.concatenate([[-4.0, 4.0], rng.uniform(-4.0, 4.0, count - 2)])
            stack *= 10.0 ** rng.permutation(exponents)[:, None]
    else:
        raise ValueError(f"unknown family {family!r}")
    return torch.from_numpy(stack).to(dtype)


# ----------------------------------------------------------------------------- the reference


def unit_gram(stack: torch.Tensor, weights: np.ndarray | None = None) -> np.ndarray:
    """C = V U U^T V in float64: U the stack's rows scaled to unit norm in float64."""
    rows = stack.to(torch.float64)
    units = rows / rows.norm(dim=1, keepdim=True)
    gram = (units @ units.T).numpy()
    gram = 0.5 * (gram + gram.T)
    if weights is not None:
        gram = gram * np.outer(weights, weights)
    return gram


def feasible(weights: np.ndarray, floor: float) -> np.ndarray:
    """``weights`` put back on {sum a = 1, a >= floor} (float64; scaling the excess)."""
    count = len(weights)
    weights = np.asarray(weights, dtype=np.float64)
    excess = np.clip(weights - floor, 0.0, None)
    spare = 1.0 - count * floor
    if excess.sum() <= 0.0 or spare <= 0.0:
        return np.full(count, 1.0 / count)
    return floor + spare * excess / excess.sum()


def infeasibility(weights: np.ndarray, floor: float) -> float:
    """|sum a - 1| + the total amount below the floor."""
    weights = np.asarray(weights, dtype=np.float64)
    return abs(float(weights.sum()) - 1.0) + float(np.clip(floor - weights, 0.0, None).sum())


def enumerate_faces(gram: np.ndarray, floor: float) -> np.ndarray:
    """Exact min of a^T C a over {sum a = 1, a >= floor} by visiting every face.

    For each set F of free weights (the others at the floor) the face's stationary point
    solves [[C_FF, 1], [1^T, 0]] [a_F; t] = [-floor C_F,rest 1; 1 - floor |rest|]
    (least squares: singular faces of affinely dependent points have many); feasible
    stationary points are candidates, the lowest one wins. 2^K - 1 small systems.
    """
    count = len(gram)
    if count > ENUMERATION_MAX_K:
        raise ValueError(f"enumeration is for K <= {ENUMERATION_MAX_K}")
    if floor * count >= 1.0 - 1e-15:
        return np.full(count, 1.0 / count)
    best, best_value = None, math.inf
    for size in range(1, count + 1):
        for free in itertools.combinations(range(count), size):
            free_list = list(free)
            rest = [index for index in range(count) if index not in free]
            system = np.ones((size + 1, size + 1))
            system[:size, :size] = gram[np.ix_(free_list, free_list)]
            system[size, size] = 0.0
            rhs = np.empty(size + 1)
            rhs[:size] = -floor * gram[np.ix_(free_list, rest)].sum(axis=1)
            rhs[size] = 1.0 - floor * len(rest)
            solution = np.linalg.lstsq(system, rhs, rcond=None)[0]
            if np.abs(system @ solution - rhs).max() > 1e-10 * (1.0 + np.abs(rhs).max()):
                continue
            if solution[:size].min() < floor - 1e-13:
                continue
            weights = np.full(count, floor)
            weights[free_list] = solution[:size]
            weights = feasible(weights, floor)
            value = float(weights @ gram @ weights)
            if value < best_value:
                best, best_value = weights, value
    if best is None:
        raise RuntimeError("no feasible stationary point found")
    return best


def clarabel_solution(gram: np.ndarray, floor: float) -> np.ndarray | None:
    """cvxpy (Clarabel, tolerances 1e-14) on ||F a||^2, F a PSD factor of C."""
    import cvxpy as cp

    eigenvalues, eigenvectors = np.linalg.eigh(gram)
    factor = (eigenvectors * np.sqrt(np.clip(eigenvalues, 0.0, None))).T
    weights = cp.Variable(len(gram))
    problem = cp.Problem(
        cp.Minimize(cp.sum_squares(factor @ weights)), [cp.sum(weights) == 1, weights >= floor]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "solution may be inaccurate": scored, not trusted
        problem.solve(
            solver=cp.CLARABEL,
            tol_gap_abs=REFERENCE_TOL,
            tol_gap_rel=REFERENCE_TOL,
            tol_feas=REFERENCE_TOL,
        )
    return None if weights.value is None else np.asarray(weights.value, dtype=np.float64)


def quadprog_solution(gram: np.ndarray, floor: float) -> np.ndarray | None:
    """qpsolvers' quadprog on 2 C + 1e-13 I (the ridge only makes it positive definite)."""
    import qpsolvers

    count = len(gram)
    return qpsolvers.solve_qp(
        2.0 * gram + QUADPROG_RIDGE * np.eye(count),
        np.zeros(count),
        A=np.ones((1, count)),
        b=np.ones(1),
        lb=np.full(count, floor),
        solver="quadprog",
    )


REFERENCE_SOLVERS = {
    "enumeration": enumerate_faces,
    "cvxpy-clarabel": clarabel_solution,
    "quadprog": quadprog_solution,
}


def reference_qp(gram: np.ndarray, floor: float) -> dict[str, Any]:
    """The lowest a^T C a of the three solvers' points, each first put back on the set."""
    if floor * len(gram) >= 1.0:
        uniform = np.full(len(gram), 1.0 / len(gram))
        value = float(uniform @ gram @ uniform)
        return {"objective": value, "weights": uniform, "solver": "uniform", "per_solver": {}}
    values: dict[str, float | None] = {}
    points: dict[str, np.ndarray] = {}
    for name, solver in REFERENCE_SOLVERS.items():
        try:
            found = solver(gram, floor)
        except Exception:  # a reference solver failing is recorded, not fatal
            found = None
        if found is None or not np.all(np.isfinite(found)):
            values[name] = None
            continue
        points[name] = feasible(found, floor)
        values[name] = float(points[name] @ gram @ points[name])
    best = min(points, key=lambda name: values[name])
    return {
        "objective": values[best],
        "weights": points[best],
        "solver": best,
        "per_solver": values,
    }


def kkt_residual(gram: np.ndarray, weights: np.ndarray, floor: float) -> float:
    """KKT violation of min a^T C a over {sum a = 1, a >= f}, in C's units (cosines).

    With b = (a - f) / (1 - K f) (b = a when f = 0) the multiplier of the sum is
    nu = b^T C a and mu_k = (C a)_k - nu >= 0 must hold, with b_k mu_k = 0. Returned:
    max(max_k -mu_k, max_k |b_k mu_k|) at ``weights`` put back on the set (the distance
    to it is reported separately). f K = 1: the distance from the uniform point.
    """
    count = len(weights)
    spare = 1.0 - count * floor
    if spare <= 1e-15:
        return float(np.abs(np.asarray(weights) - 1.0 / count).max())
    point = feasible(weights, floor)
    share = (point - floor) / spare
    along = gram @ point
    slack = along - float(share @ along)
    return max(float(np.max(-slack)), 0.0, float(np.max(np.abs(share * slack))))


# ----------------------------------------------------------------------------- one case


@dataclass(frozen=True)
class Case:
    """One stack and the options both methods get."""

    family: str
    count: int
    dim: int
    dtype: str
    seed: int = 0
    reward_weights: tuple[float, ...] | None = None
    floor: float = 0.0
    repeats: int = 5
    group: str = "accuracy"
    threads: int | None = None  # torch threads while timing (None: as set)

    @property
    def label(self) -> str:
        options = []
        if self.reward_weights is not None:
            options.append("w=" + ",".join(f"{value:g}" for value in self.reward_weights))
        if self.floor:
            options.append(f"floor={self.floor:g}")
        extra = f" [{'; '.join(options)}]" if options else ""
        threads = f" {self.threads} thread{'s' if self.threads > 1 else ''}" if self.threads else ""
        return (
            f"{self.family} K={self.count} D={self.dim:.0e} {self.dtype} s{self.seed}{extra}"
            f"{threads}"
        )


def our_mgda(case: Case) -> MGDA:
    """Our MGDA set up to compute what the release does: normalize-and-rescale, the
    release's floor as a bound inside the QP, its reward weights on the unit gradients."""
    return MGDA(
        normalize=True,
        alpha_lower_bound=case.floor,
        unit_weights=None if case.reward_weights is None else list(case.reward_weights),
    )


def cosine(first: torch.Tensor, second: torch.Tensor) -> float | None:
    first, second = first.to(torch.float64), second.to(torch.float64)
    norms = float(first.norm()) * float(second.norm())
    return None if norms == 0.0 else float(first @ second) / norms


def score(
    alpha: np.ndarray,
    exact: dict[str, Any],
    own_gram: np.ndarray,
    floor: float,
) -> dict[str, Any]:
    """Gap and KKT residual on the exact float64 Gram, and the gap on the method's own Gram
    (the one its solver saw: isolates the solver from the Gram's precision)."""
    gram = exact["gram"]
    point = feasible(alpha, floor)
    own_reference = reference_qp(own_gram, floor)
    return {
        "alpha": alpha.tolist(),
        "infeasibility": infeasibility(alpha, floor),
        "objective": float(point @ gram @ point),
        "gap": float(point @ gram @ point) - exact["objective"],
        "kkt": kkt_residual(gram, alpha, floor),
        "kkt_mogradient_metric": simplex_kkt_residual(gram, point, floor),
        "own_gram_gap": float(point @ own_gram @ point) - own_reference["objective"],
        "own_gram_min_eigenvalue": float(np.linalg.eigvalsh(own_gram).min()),
        "own_gram_reference_solver": own_reference["solver"],
    }


def run_case(case: Case) -> dict[str, Any]:
    """Both methods on one stack: scored on their first calls, then timed interleaved."""
    started = time.perf_counter()
    stack = make_stack(case.family, case.count, case.dim, case.seed, DTYPES[case.dtype])
    rows = list(stack)
    weights = None if case.reward_weights is None else np.asarray(case.reward_weights)
    mgda = our_mgda(case)

    release = release_balance(rows, case.reward_weights, case.floor)
    ours = mgda(stack)
    if release.reason != "none" or ours.fallback is not None or ours.dropped:
        raise RuntimeError(f"{case.label}: a fallback in a regular case ({release.reason})")

    gram = unit_gram(stack, weights)
    reference = reference_qp(gram, release.solver["floor"])
    exact = {"gram": gram, **reference}
    floor = release.solver["floor"]
    norms64 = stack.to(torch.float64).norm(dim=1)
    units = stack.to(torch.float64) / norms64[:, None]
    scale = 1.0 if weights is None else torch.from_numpy(weights)
    best_direction = float(norms64.mean()) * (
        (torch.from_numpy(reference["weights"]) * scale) @ units
    )
    del units

    our_alpha = np.asarray(ours.extras["alpha"], dtype=np.float64)
    our_norms = np.sqrt(np.diag(ours.gram.numpy()))
    our_gram = ours.gram.numpy() / np.outer(our_norms, our_norms)
    if weights is not None:
        our_gram = our_gram * np.outer(weights, weights)
    release_alpha = release.alphas.numpy().astype(np.float64)
    scores = {
        "release": score(release_alpha, exact, release.solver["gram"], floor),
        "ours": score(our_alpha, exact, our_gram, floor),
    }
    scores["release"]["slsqp"] = {
        key: release.solver[key] for key in ("success", "iterations", "message")
    }
    scores["ours"]["self_reported_kkt"] = ours.kkt_residual
    for name, direction in (("release", release.direction), ("ours", ours.direction)):
        scores[name]["cos_to_exact"] = cosine(direction, best_direction)
        scores[name]["direction_norm_over_exact"] = (
            float(direction.to(torch.float64).norm()) / float(best_direction.norm())
            if float(best_direction.norm()) > 0
            else None
        )
    both = cosine(release.direction, ours.direction)
    difference = (release.direction.to(torch.float64) - ours.direction.to(torch.float64)).norm()
    result: dict[str, Any] = {
        "label": case.label,
        "group": case.group,
        "family": case.family,
        "num_objectives": case.count,
        "dim": case.dim,
        "dtype": case.dtype,
        "seed": case.seed,
        "threads": case.threads or torch.get_num_threads(),
        "reward_weights": None if weights is None else list(case.reward_weights),
        "floor": case.floor,
        "effective_floor": floor,
        "reference": {
            "objective": reference["objective"],
            "solver": reference["solver"],
            "per_solver": reference["per_solver"],
            "alpha": reference["weights"].tolist(),
        },
        "direction_defined": reference["objective"] >= DEFINED_MIN_OBJECTIVE,
        "alpha_max_abs_diff": float(np.abs(release_alpha - our_alpha).max()),
        "cos_release_ours": both,
        "direction_rel_diff": (
            float(difference) / float(ours.direction.to(torch.float64).norm())
            if float(ours.direction.norm()) > 0
            else None
        ),
        "release": scores["release"],
        "ours": scores["ours"],
    }
    del best_direction
    threads = torch.get_num_threads()
    torch.set_num_threads(case.threads or threads)
    try:
        timings = interleaved_times(
            {
                "release": lambda: release_balance(rows, case.reward_weights, case.floor),
                "ours": lambda: mgda(stack),
            },
            case.repeats,
        )
    finally:
        torch.set_num_threads(threads)
    for name, samples in timings.items():
        result[name]["time"] = timing_summary(samples)
        if case.group != "timing":  # per-round samples only where the timing is the point
            del result[name]["time"]["times_ms"], result[name]["time"]["cpu_times_ms"]
    ratios = [
        slow / fast
        for slow, fast in zip(timings["release"]["wall"], timings["ours"]["wall"], strict=True)
    ]
    result["time_ratio_release_over_ours"] = {
        "of_medians": result["release"]["time"]["median_ms"] / result["ours"]["time"]["median_ms"],
        "median_of_rounds": statistics.median(ratios),
        "of_fastest": result["release"]["time"]["min_ms"] / result["ours"]["time"]["min_ms"],
        "cpu_of_medians": result["release"]["time"]["cpu_median_ms"]
        / result["ours"]["time"]["cpu_median_ms"],
    }
    result["repeats"] = case.repeats
    result["case_seconds"] = time.perf_counter() - started
    return result


# ----------------------------------------------------------------------------- edge cases


def edge_stacks() -> list[tuple[str, torch.Tensor]]:
    """Inputs where the two sides' validity rules or fallbacks may part ways."""
    rng = np.random.default_rng(11)
    base = torch.from_numpy(rng.standard_normal((3, 64)))
    zero_row = base.clone()
    zero_row[1] = 0.0
    tiny_row = base.clone()
    tiny_row[1] *= 1e-13 / float(tiny_row[1].norm())
    nan_row = base.clone()
    nan_row[2, 5] = float("nan")
    one_valid = torch.zeros_like(base)
    one_valid[0] = base[0]
    return [
        ("one zero row", zero_row),
        ("one row of norm 1e-13", tiny_row),
        ("one row with a NaN", nan_row),
        ("only one nonzero row", one_valid),
        ("all rows zero", torch.zeros_like(base)),
        ("K = 1", base[:1].clone()),
    ]


def run_edges() -> list[dict[str, Any]]:
    results = []
    for label, stack in edge_stacks():
        release = release_balance(list(stack))
        ours = MGDA()(stack)
        direction = ours.direction if ours.direction is not None else torch.zeros(stack.shape[1])
        results.append(
            {
                "label": label,
                "release_reason": release.reason,
                "release_alphas": release.alphas.tolist(),
                "release_direction_norm": float(release.direction.norm()),
                "ours_fallback": ours.fallback,
                "ours_dropped": list(ours.dropped),
                "ours_alpha": ours.extras.get("alpha"),
                "ours_direction_norm": float(direction.norm()),
                "cos_release_ours": cosine(release.direction, direction),
            }
        )
    return results


# ----------------------------------------------------------------------------- the plan


def cases_for(quick: bool) -> list[Case]:
    if quick:
        accuracy = [
            Case(family, count, 1000, dtype, repeats=1)
            for family in ("gaussian", "conflicting", "opposed")
            for count in (2, 5)
            for dtype in DTYPES
        ]
        options = [
            Case(
                "conflicting",
                3,
                1000,
                "float64",
                reward_weights=(1.0, 2.0, 0.5),
                repeats=1,
                group="options",
            ),
            Case("conflicting", 5, 1000, "float64", floor=0.05, repeats=1, group="options"),
        ]
        timing = [
            Case("gaussian", 5, 10_000, "float32", repeats=1, group="timing", threads=threads)
            for threads in TIMING_THREADS
        ]
        return accuracy + options + timing
    accuracy = [
        Case(family, count, dim, dtype, seed=seed, repeats=5)
        for family in FAMILIES
        for dim in (1000, 100_000)
        for count in COUNTS
        for dtype in DTYPES
        for seed in (range(3) if dim == 1000 else range(2))
    ]
    options = [
        Case(
            family,
            count,
            1000,
            dtype,
            seed=seed,
            reward_weights=weights,
            floor=floor,
            repeats=3,
            group="options",
        )
        for family in ("gaussian", "conflicting")
        for count in (3, 5)
        for dtype in DTYPES
        for seed in range(2)
        for weights, floor in (
            (tuple(np.geomspace(0.5, 2.0, count).round(3).tolist()), 0.0),
            (None, 0.05),
            (None, 0.5),
            (tuple(np.geomspace(2.0, 0.5, count).round(3).tolist()), 0.05),
        )
    ]
    timing = [
        Case(
            "gaussian",
            count,
            1_000_000,
            dtype,
            repeats=TIMING_REPEATS,
            group="timing",
            threads=threads,
        )
        for threads in TIMING_THREADS
        for count in COUNTS
        for dtype in DTYPES
    ]
    return accuracy + options + timing


# ----------------------------------------------------------------------------- the report


def _fmt(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "n/a"
    if value == 0.0:
        return "0"
    return f"{value:.{digits}e}"


def _max(values: list[float | None]) -> float | None:
    found = [value for value in values if value is not None]
    return max(found) if found else None


def _min(values: list[float | None]) -> float | None:
    found = [value for value in values if value is not None]
    return min(found) if found else None


def summarize(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures the reading at the top of the report quotes."""
    scored = [case for case in cases if case["group"] in ("accuracy", "options")]
    defined = [case for case in scored if case["direction_defined"]]
    below = [case for case in defined if case["cos_release_ours"] < COS_CLAIM]
    timing = [case for case in cases if case["group"] == "timing"]
    summary: dict[str, Any] = {
        "cases": len(scored),
        "direction_defined_cases": len(defined),
        "min_cos_release_ours_defined": _min([case["cos_release_ours"] for case in defined]),
        "min_cos_release_ours_defined_float64": _min(
            [case["cos_release_ours"] for case in defined if case["dtype"] == "float64"]
        ),
        "cos_below_claim": [
            {
                "label": case["label"],
                "cos": case["cos_release_ours"],
                "f_star": case["reference"]["objective"],
            }
            for case in below
        ],
        "max_alpha_diff": _max([case["alpha_max_abs_diff"] for case in scored]),
        "max_alpha_diff_independent_families": _max(
            [
                case["alpha_max_abs_diff"]
                for case in scored
                if case["family"] not in DEPENDENT_FAMILIES
            ]
        ),
        "slsqp_failures": sum(not case["release"]["slsqp"]["success"] for case in scored),
    }
    for name in ("release", "ours"):
        summary[f"{name}_min_cos_to_exact_defined"] = _min(
            [case[name]["cos_to_exact"] for case in defined]
        )
        for dtype in (*DTYPES, "all"):
            subset = [case for case in scored if dtype in ("all", case["dtype"])]
            convex = [case for case in subset if case[name]["own_gram_min_eigenvalue"] >= 0.0]
            summary[f"{name}_{dtype}"] = {
                "max_gap": _max([case[name]["gap"] for case in subset]),
                "min_gap": _min([case[name]["gap"] for case in subset]),
                "max_own_gram_gap_psd": _max([case[name]["own_gram_gap"] for case in convex]),
                "max_kkt": _max([case[name]["kkt"] for case in subset]),
                "max_kkt_mogradient_metric": _max(
                    [case[name]["kkt_mogradient_metric"] for case in subset]
                ),
            }
            if name == "ours":
                summary[f"{name}_{dtype}"]["max_self_reported_kkt"] = _max(
                    [case["ours"]["self_reported_kkt"] for case in subset]
                )
    summary["timing"] = {
        f"K={case['num_objectives']} {case['dtype']} D={case['dim']:.0e} "
        f"threads={case['threads']}": {
            "dim": case["dim"],
            "threads": case["threads"],
            "count": case["num_objectives"],
            "of_medians": case["time_ratio_release_over_ours"]["of_medians"],
            "median_of_rounds": case["time_ratio_release_over_ours"]["median_of_rounds"],
            "cpu_of_medians": case["time_ratio_release_over_ours"]["cpu_of_medians"],
            "of_fastest": case["time_ratio_release_over_ours"]["of_fastest"],
        }
        for case in timing
    }
    return summary


def _verdict(holds: bool) -> str:
    return "**Holds**" if holds else "**Does not hold**"


def reading(summary: dict[str, Any], quick: bool) -> str:
    """The issue's claims, each beside what this run measured."""
    release, release64 = summary["release_all"], summary["release_float64"]
    ours64, ours32 = summary["ours_float64"], summary["ours_float32"]
    below = summary["cos_below_claim"]
    worst = min(below, key=lambda entry: entry["cos"]) if below else None
    cos_line = (
        f"- *Where a direction is defined, cos >= {COS_CLAIM}.* "
        f"{_verdict(not below)}: min cos(release, ours) = "
        f"{_fmt(summary['min_cos_release_ours_defined'], 8)} over the "
        f"{summary['direction_defined_cases']} of {summary['cases']} stacks with "
        f"f* >= {DEFINED_MIN_OBJECTIVE:g} (float64 inputs alone: "
        f"{_fmt(summary['min_cos_release_ours_defined_float64'], 8)})"
    )
    if worst is not None:
        cos_line += (
            f"; {len(below)} stacks fall below {COS_CLAIM}, with f* from "
            f"{_fmt(min(entry['f_star'] for entry in below))} to "
            f"{_fmt(max(entry['f_star'] for entry in below))} (worst: {worst['label']}). "
            "The deviation is the release's: its direction's min cosine with the exact "
            f"one is {_fmt(summary['release_min_cos_to_exact_defined'], 8)}, ours' "
            f"{_fmt(summary['ours_min_cos_to_exact_defined'], 13)}"
        )
    cos_line += (
        f". Max |alpha difference| {_fmt(summary['max_alpha_diff_independent_families'])} on "
        f"the gaussian, conflicting and wide_scale stacks ({_fmt(summary['max_alpha_diff'])} "
        "over all: with near-duplicate or dependent rows alpha is not unique, only the "
        "direction is)."
    )
    own = release["max_own_gram_gap_psd"]
    gap_line = (
        f"- *The release leaves optimality gaps up to 8e-8 and KKT residuals up to 8e-5.* "
        f"On the exact float64 unit-gradient Gram the release's gap reaches "
        f"{_fmt(release['max_gap'])} ({_verdict(release['max_gap'] <= 8e-8)} as a bound; "
        f"float64 inputs: {_fmt(release64['max_gap'])}) and its KKT residual "
        f"{_fmt(release['max_kkt'])} ({_verdict(release['max_kkt'] <= 8e-5)} as a bound; "
        f"mogradient's relative metric: {_fmt(release['max_kkt_mogradient_metric'])}). "
        f"On the float32 Gram its own solver saw (where that Gram is PSD) the gap reaches "
        f"{_fmt(own)}, and SLSQP reported failure on {summary['slsqp_failures']} stacks"
    )
    if own is not None and release["max_gap"] and own >= 0.5 * release["max_gap"]:
        gap_line += (
            ": the gap is SLSQP stopping early (ftol 1e-8 on the change of the objective), "
            "not the float32 Gram's rounding"
        )
    gap_line += "."
    ours_ok = max(ours64["max_gap"], ours64["max_kkt"]) <= 1e-12
    ours32_ok = max(ours32["max_gap"], ours32["max_kkt"]) <= 1e-12
    ours_line = (
        f"- *Ours <= 1e-12.* {_verdict(ours_ok)} for float64 inputs: gap up to "
        f"{_fmt(ours64['max_gap'])}, KKT residual up to {_fmt(ours64['max_kkt'])} "
        f"(self-reported up to {_fmt(ours64['max_self_reported_kkt'])}). "
        f"{'Also' if ours32_ok else 'Not'} for float32 inputs measured against the exact "
        f"Gram: gap up to {_fmt(ours32['max_gap'])}, KKT up to {_fmt(ours32['max_kkt'])}"
    )
    if not ours32_ok:
        ours_line += (
            ", since our Gram of a float32 stack is summed in float32 (on that Gram, where "
            f"PSD, the gap is at most {_fmt(ours32['max_own_gram_gap_psd'])}; self-reported "
            f"KKT up to {_fmt(ours32['max_self_reported_kkt'])}); the release's float32 Gram "
            "carries the same rounding"
        )
    ours_line += "."
    lines = [
        "The issue's claims, and what this run measured"
        + (" (a --quick smoke run: small D, few cases, one repeat)" if quick else "")
        + ":",
        "",
        cos_line,
        gap_line,
        ours_line,
    ]
    timing = summary["timing"]
    dims = sorted({entry["dim"] for entry in timing.values()})
    counts = sorted({entry["count"] for entry in timing.values()})
    parts = []
    claim_holds = []
    for threads in sorted({entry["threads"] for entry in timing.values()}):
        subset = {key: entry for key, entry in timing.items() if entry["threads"] == threads}
        medians = [entry["of_medians"] for entry in subset.values()]
        fastest = [entry["of_fastest"] for entry in subset.values()]
        cpu = [entry["cpu_of_medians"] for entry in subset.values()]
        claim_holds.append((threads, min(medians) >= 3, max(medians) <= 9))
        parts.append(
            f"{threads} torch thread{'s' if threads > 1 else ''}: ratio of median wall times "
            f"{min(medians):.1f}x to {max(medians):.1f}x (CPU time {min(cpu):.1f}x to "
            f"{max(cpu):.1f}x; fastest rounds {min(fastest):.1f}x to {max(fastest):.1f}x)"
        )
    if timing:
        if dims != [1_000_000]:
            verdict = "Not tested at D = 1e6 in this run."
        else:
            verdict = " ".join(
                f"With {threads} thread{'s' if threads > 1 else ''}: at least 3x "
                f"{_verdict(low)}, at most 9x {_verdict(high)}."
                for threads, low, high in claim_holds
            )
        lines.append(
            f"- *Ours is 3-9x faster at D = 1e6.* Release / ours at D = "
            f"{', '.join(f'{d:.0e}' for d in dims)}, K in {{{', '.join(map(str, counts))}}}, "
            f"{'; '.join(parts)}. {verdict} The machine's 2 cores were shared with other "
            "jobs (load average below): with 2 threads a parallel region waits for a "
            "descheduled thread, which can inflate the release's many passes most "
            "(compare the two thread counts in the table)."
        )
    return "\n".join(lines)


def _accuracy_scope(cases: list[dict[str, Any]]) -> str:
    accuracy = [case for case in cases if case["group"] == "accuracy"]
    dims = sorted({case["dim"] for case in accuracy})
    counts = sorted({case["num_objectives"] for case in accuracy})
    seeds = ", ".join(
        f"{len({case['seed'] for case in accuracy if case['dim'] == dim})} at D = {dim:.0e}"
        for dim in dims
    )
    return f"K = {', '.join(map(str, counts))}; seeds: {seeds}"


def _own_gram_gap(cases: list[dict[str, Any]], name: str) -> float | None:
    """The largest gap on the method's own Gram, over the stacks where that Gram is PSD."""
    return _max(
        [
            case[name]["own_gram_gap"]
            for case in cases
            if case[name]["own_gram_min_eigenvalue"] >= 0.0
        ]
    )


def family_table(cases: list[dict[str, Any]]) -> str:
    header = [
        "family",
        "dtype",
        "stacks",
        "max abs d-alpha",
        "min cos (defined)",
        "gap release",
        "gap ours",
        "own-Gram gap release (PSD)",
        "own-Gram gap ours (PSD)",
        "KKT release",
        "KKT ours",
        "SLSQP fails",
    ]
    rows = []
    for family in FAMILIES:
        for dtype in DTYPES:
            subset = [
                case
                for case in cases
                if case["group"] == "accuracy"
                and case["family"] == family
                and case["dtype"] == dtype
            ]
            if not subset:
                continue
            defined = [case for case in subset if case["direction_defined"]]
            rows.append(
                [
                    family,
                    dtype,
                    str(len(subset)),
                    _fmt(_max([case["alpha_max_abs_diff"] for case in subset])),
                    _fmt(_min([case["cos_release_ours"] for case in defined]), 8)
                    if defined
                    else "undefined",
                    _fmt(_max([case["release"]["gap"] for case in subset])),
                    _fmt(_max([case["ours"]["gap"] for case in subset])),
                    _fmt(_own_gram_gap(subset, "release")),
                    _fmt(_own_gram_gap(subset, "ours")),
                    _fmt(_max([case["release"]["kkt"] for case in subset])),
                    _fmt(_max([case["ours"]["kkt"] for case in subset])),
                    str(sum(not case["release"]["slsqp"]["success"] for case in subset)),
                ]
            )
    return markdown_table(header, rows)


def case_table(cases: list[dict[str, Any]], group: str) -> str:
    header = [
        "stack",
        "f*",
        "max abs d-alpha",
        "cos(release, ours)",
        "gap release",
        "gap ours",
        "KKT release",
        "KKT ours",
        "SLSQP it",
        "release ms",
        "ours ms",
        "ratio",
    ]
    rows = [
        [
            case["label"],
            _fmt(case["reference"]["objective"], 2),
            _fmt(case["alpha_max_abs_diff"]),
            (_fmt(case["cos_release_ours"], 8) if case["cos_release_ours"] is not None else "n/a")
            + ("" if case["direction_defined"] else " (undef.)"),
            _fmt(case["release"]["gap"]),
            _fmt(case["ours"]["gap"]),
            _fmt(case["release"]["kkt"]),
            _fmt(case["ours"]["kkt"]),
            str(case["release"]["slsqp"]["iterations"])
            + ("" if case["release"]["slsqp"]["success"] else " (failed)"),
            f"{case['release']['time']['median_ms']:.2f}",
            f"{case['ours']['time']['median_ms']:.2f}",
            f"{case['time_ratio_release_over_ours']['of_medians']:.1f}x",
        ]
        for case in cases
        if case["group"] == group
    ]
    return markdown_table(header, rows)


def below_table(summary: dict[str, Any]) -> str:
    rows = [
        [entry["label"], _fmt(entry["f_star"], 2), _fmt(entry["cos"], 8)]
        for entry in sorted(summary["cos_below_claim"], key=lambda entry: entry["cos"])
    ]
    if not rows:
        return "None."
    return markdown_table(["stack", "f*", "cos(release, ours)"], rows)


def timing_table(cases: list[dict[str, Any]]) -> str:
    header = [
        "threads",
        "K",
        "dtype",
        "D",
        "release ms (CPU ms)",
        "ours ms (CPU ms)",
        "ratio of medians",
        "median of per-round ratios",
        "CPU ratio",
        "ratio of fastest",
        "repeats",
        "cos(release, ours)",
    ]
    rows = [
        [
            str(case["threads"]),
            str(case["num_objectives"]),
            case["dtype"],
            f"{case['dim']:.0e}",
            f"{case['release']['time']['median_ms']:.1f} "
            f"({case['release']['time']['cpu_median_ms']:.1f})",
            f"{case['ours']['time']['median_ms']:.1f} "
            f"({case['ours']['time']['cpu_median_ms']:.1f})",
            f"{case['time_ratio_release_over_ours']['of_medians']:.2f}x",
            f"{case['time_ratio_release_over_ours']['median_of_rounds']:.2f}x",
            f"{case['time_ratio_release_over_ours']['cpu_of_medians']:.2f}x",
            f"{case['time_ratio_release_over_ours']['of_fastest']:.2f}x",
            str(case["repeats"]),
            _fmt(case["cos_release_ours"], 8),
        ]
        for case in cases
        if case["group"] == "timing"
    ]
    return markdown_table(header, rows)


def edge_table(edges: list[dict[str, Any]]) -> str:
    header = ["input", "release", "release alphas", "ours", "ours alpha", "cos(release, ours)"]
    rows = [
        [
            edge["label"],
            edge["release_reason"],
            "[" + ", ".join(f"{value:.4g}" for value in edge["release_alphas"]) + "]",
            (edge["ours_fallback"] or "solved")
            + (f", dropped {edge['ours_dropped']}" if edge["ours_dropped"] else ""),
            "n/a"
            if edge["ours_alpha"] is None
            else "[" + ", ".join(f"{value:.4g}" for value in edge["ours_alpha"]) + "]",
            _fmt(edge["cos_release_ours"], 8),
        ]
        for edge in edges
    ]
    return markdown_table(header, rows)


def markdown_report(payload: dict[str, Any]) -> str:
    cases = payload["cases"]
    versions = ", ".join(f"{name} {version}" for name, version in payload["versions"].items())
    return f"""# The MARBLE release's balancer vs our MGDA (normalize-and-rescale)

{reading(payload["summary"], payload["mode"] == "quick")}

{machine_markdown(payload["machine"])} Solvers: {versions}. Total run time
{payload["total_seconds"]:.0f} s. Produced by `tools/marble_release_parity.py`
({payload["mode"]} mode).

## What is compared

- **Release**: this tool's own implementation of the balancer of aim-uofa/MARBLE @1bf9543
  (`flow_grpo/pareto_balancer`), written from its description (validity: finite and raw
  norm > {GRAD_EPS:g}; u_k = g_k / max(||g_k||, {GRAD_EPS:g}), times the reward weight;
  float32 Gram cast to float64; SLSQP from 1/K, bounds (floor, None), sum = 1,
  ftol {SLSQP_FTOL:g}, maxiter {SLSQP_MAXITER}; a failed run's iterate still used unless it
  sums below {FAILED_SUM:g}; alpha clipped to the floor, cast to float32 and renormalized;
  floor K > 1 -> 1/K; fallbacks; direction = sum alpha_k w_k u_k times the float32 mean raw
  norm of the valid objectives). The rules are tested in
  tests/test_marble_release_parity.py.
- **Ours**: `MGDA(normalize=True, alpha_lower_bound=floor, unit_weights=w)` on the same K x D
  stack (the release's floor is a bound inside the QP, its reward weights scale the unit
  gradients: both options solve the release's problem exactly).
  Note: ours accumulates the Gram of a float32 stack in float32, as the release's float32
  Gram does; both are then compared with the exact float64 Gram.
- **Reference**: min a^T C a over {{sum a = 1, a >= floor}}, C = diag(w) U U^T diag(w) with U
  the stack's rows scaled to unit norm in float64: the lowest objective among an enumeration
  of all 2^K - 1 faces (stationary point of each by least squares), cvxpy with Clarabel
  (tolerances {REFERENCE_TOL:g}) and quadprog (ridge {QUADPROG_RIDGE:g}), each point first put
  back on the feasible set. The winning solver is recorded per stack in the JSON.
- **gap** = a^T C a - f* for each method's alpha (put back on the feasible set in float64;
  the release's float32 alpha sums to 1 only to ~6e-8). **own-Gram gap**: the same on the
  Gram the method's solver saw (release: float32 product of the float32 unit vectors; ours:
  its Gram of the stack, summed in the stack's dtype), against a reference solved on that
  Gram: the solver's own error, without the Gram's rounding (where that Gram is PSD: the
  float32 Grams of near-duplicate, opposed and rank-deficient stacks can have eigenvalues
  ~-1e-8, where "min" is a nonconvex problem and the figure means little).
- **KKT**: with b = (a - f) / (1 - K f), nu = b^T C a and mu = C a - nu:
  max(max_k -mu_k, max_k |b_k mu_k|), in cosine units; the JSON also holds mogradient's
  relative metric (`simplex_kkt_residual`) for both and our self-reported residual.
- **cos**: between the two directions (float64). A direction is *defined* where
  f* >= {DEFINED_MIN_OBJECTIVE:g}, i.e. ||d*|| >= 1e-3 of the mean norm; where zero is in the
  hull (the opposed family, f* = 0) both directions are rounding noise and their cosine is
  not meaningful (marked "undef."). The JSON also has each direction's cosine with the
  reference direction m sum a*_k w_k u_k.
- **time**: one call each (the release: the K row views of the stack as its list of
  vectors), interleaved in rotating order, median wall ms (process CPU ms in the timing
  table; it sums both threads). Ratio = release / ours.

Stacks ({", ".join(FAMILIES)}), seeds fixed:
{inspect.getdoc(make_stack).split(chr(10), 2)[2].strip()}

## Timing (Gaussian stacks)

{timing_table(cases)}

## Accuracy by family ({_accuracy_scope(cases)}; maxima over the stacks)

{family_table(cases)}

## Release options (reward weights, floor; D = 1e3)

A floor of 0.5 exceeds 1/K for K = 3 and 5, so both sides use 1/K (uniform alpha).

{case_table(cases, "options")}

## Edge cases (validity and fallbacks; K x 64 float64)

{edge_table(payload["edges"])}

The release counts a gradient of norm <= {GRAD_EPS:g} as absent; ours drops only zero or
non-finite gradients and normalizes any other (its Gram is scaled row by row), so a
gradient of norm 1e-13 gets a full unit vector's say. Ours reports a lone usable gradient
as `single_objective` (weight 1, no rescale: its raw gradient, as the release's
`single_valid`).

## Stacks where cos(release, ours) < {COS_CLAIM} with a defined direction

{below_table(payload["summary"])}

## Every stack of seed 0 (the other seeds are in the JSON)

{case_table([case for case in cases if case["seed"] == 0], "accuracy")}
"""


def solver_versions() -> dict[str, str]:
    versions = {}
    for name in ("scipy", "cvxpy", "clarabel", "qpsolvers", "quadprog"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="small D, few cases, one repeat")
    parser.add_argument("--out", type=Path, help="results folder (default: benchmarks/results)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    load_start = os.getloadavg()
    cases = []
    for case in cases_for(args.quick):
        print(case.label, flush=True)
        cases.append(run_case(case))
    payload: dict[str, Any] = {
        "machine": {**machine_info(), "loadavg_1_5_15_start": load_start},
        "versions": solver_versions(),
        "mode": "quick" if args.quick else "full",
        "direction_defined_min_objective": DEFINED_MIN_OBJECTIVE,
        "cases": cases,
        "edges": run_edges(),
    }
    payload["summary"] = summarize(cases)
    payload["total_seconds"] = time.perf_counter() - started
    markdown = markdown_report(payload)
    print(markdown)
    if args.out is not None or not args.quick:  # a smoke run never replaces results
        json_path, md_path = write_results(NAME, payload, markdown, args.out)
        print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
