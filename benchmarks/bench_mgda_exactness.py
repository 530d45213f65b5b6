"""Exactness and speed of MGDA and UPGrad: mogradient vs TorchJD on the same float32 stacks.

Why: two claims the core's exact solvers answer (docs/core/exactness.md): Frank-Wolfe MGDA
stops far from the optimum, and float32 Grams of large rank-deficient stacks break QP-based
methods. This script measures both claims, and our own cost, on K x D stacks built to have
conflicts and near rank deficiency (results: docs/benchmarks/index.md). Both libraries get
the float32 stack, so every timing includes the Gram computation and the final combination.

Run: ``python benchmarks/bench_mgda_exactness.py [--quick]``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import math
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torchjd.aggregation as tja
from common import (
    interleaved_times,
    machine_info,
    machine_markdown,
    markdown_table,
    timing_summary,
    write_results,
)

from mogradient._gram import accumulate_gram
from mogradient._qp import solve_simplex_qp
from mogradient.harmonizers import HARMONIZERS, MGDA, combine

NAME = "mgda_exactness"
CONFLICT_SCALE = 2.0
NOISE_LEVEL = 1e-3
GRAM_CHUNK = 1 << 20
QP_BACKENDS = ("builtin", "cvxpy", "qpsolvers:quadprog")
SPEED_CASE = (5, 20_000_000)
PLAIN = "mogradient MGDA(normalize=False)"
NORMALIZE = "mogradient MGDA() [normalize]"
TORCHJD_MGDA = "torchjd MGDA()"
ONE_READ = "one read: stack.sum()"
TWO_READS = "two reads: stack.sum() twice"
GRAM_ONLY = "mogradient Gram only: accumulate_gram(stack)"
DIRECTION_ONLY = "mogradient direction only: combine(stack, w)"
THEIR_GRAM_ONLY = "TorchJD Gram only: stack @ stack.T"
THEIR_DIRECTION_ONLY = "TorchJD direction only: w @ stack"
NEAR_SINGULAR_KINDS = ("opposed_pair", "near_duplicates", "rank_deficient")
# (label, dtype, exponent range of the gradient norms)
SPREADS = (
    ("spread 1e-6..1e6", torch.float64, (-6.0, 6.0)),
    ("spread 1e-16..1e16", torch.float64, (-16.0, 16.0)),
    ("spread 1e-36..1e36", torch.float32, (-36.0, 36.0)),
)
STRESS_COUNTS = (3, 5, 8)
# A method whose first call takes longer is timed by that call alone, not repeated.
SLOW_CALL_S = 2.0
STRESS_TIGHT = {"tol_gap_abs": 1e-15, "tol_gap_rel": 1e-15, "tol_feas": 1e-15, "max_iter": 400}


@dataclass(frozen=True)
class Case:
    """One stack shape; the seed makes the stack reproducible."""

    num_objectives: int
    dim: int
    seed: int
    repeats: int


@dataclass(frozen=True)
class Method:
    """A library call that takes the float32 stack and returns its weights (float64)."""

    label: str
    problem: str
    run: Callable[[torch.Tensor], torch.Tensor]


# ----------------------------------------------------------------------------- the stacks


def conflicting_stack(num_objectives: int, dim: int, seed: int) -> torch.Tensor:
    """K x D float32 stack: rank-r shared structure with conflicts, plus small noise.

    g_k = s_k * (b_0 + sum_{j>=1} c_kj b_j + n_k): b_j are r random near-orthonormal
    directions (r = max(2, K // 2)), every objective shares b_0 (so a common descent
    direction exists), the conflict coefficients c_kj ~ N(0, 2^2) make many pairs
    anti-correlated, and the last objective's conflict coefficients are the negation of
    the first's, rescaled to norm 2, so that pair always conflicts (cosine -0.6 before
    scaling and noise). n_k is isotropic noise with norm 1e-3 of the structured part.
    Scales s_k = 10^U(-1, 1) spread gradient norms over two decades. For K = 5, 10 the
    K - r smallest Gram eigenvalues come from the noise alone, ~1e-9 of the largest
    diagonal entry: the Gram is near rank deficient.
    """
    generator = torch.Generator().manual_seed(seed)
    rank = max(2, num_objectives // 2)
    coefficients = CONFLICT_SCALE * torch.randn(num_objectives, rank, generator=generator)
    coefficients[0, 1:] *= CONFLICT_SCALE / coefficients[0, 1:].norm()
    coefficients[-1, 1:] = -coefficients[0, 1:]
    coefficients[:, 0] = 1.0
    scales = 10.0 ** (2.0 * torch.rand(num_objectives, generator=generator) - 1.0)
    basis = torch.randn(rank, dim, generator=generator).div_(math.sqrt(dim))
    stack = coefficients @ basis
    del basis
    for row in range(num_objectives):
        noise_norm = NOISE_LEVEL * float(coefficients[row].norm())
        noise = torch.randn(dim, generator=generator).mul_(noise_norm / math.sqrt(dim))
        stack[row].add_(noise).mul_(float(scales[row]))
    return stack


def float64_gram(stack: torch.Tensor) -> np.ndarray:
    """Reference Gram: float64 accumulation over column chunks, not symmetrized or clipped."""
    num_objectives, dim = stack.shape
    gram = torch.zeros(num_objectives, num_objectives, dtype=torch.float64)
    for start in range(0, dim, GRAM_CHUNK):
        chunk = stack[:, start : start + GRAM_CHUNK].to(torch.float64)
        gram += chunk @ chunk.T
    return gram.numpy()


def stack_diagnostics(stack: torch.Tensor, gram: np.ndarray) -> dict[str, float]:
    """How conflicting and how rank deficient the stack is, and how wrong float32 gets."""
    norms = np.sqrt(np.diag(gram))
    cosines = gram / np.outer(norms, norms)
    off_diagonal = cosines[~np.eye(len(gram), dtype=bool)]
    max_diag = float(np.max(np.diag(gram)))
    gram32 = (stack @ stack.T).to(torch.float64).numpy()
    return {
        "min_pairwise_cosine": float(off_diagonal.min()) if off_diagonal.size else 1.0,
        "conflicting_pairs_fraction": float(np.mean(off_diagonal < 0)) if off_diagonal.size else 0,
        "min_eig_over_max_diag_float64": float(np.linalg.eigvalsh(gram).min() / max_diag),
        "min_eig_over_max_diag_float32": float(
            np.linalg.eigvalsh(0.5 * (gram32 + gram32.T)).min() / max_diag
        ),
        "float32_gram_max_rel_error": float(np.max(np.abs(gram32 - gram)) / max_diag),
    }


# ----------------------------------------------------------------------------- the methods


def mogradient_runner(harmonizer: Callable[[torch.Tensor], Any]) -> Callable:
    """mogradient returns weights on the raw gradients directly."""

    def run(stack: torch.Tensor) -> torch.Tensor:
        return harmonizer(stack).weights.to(torch.float64)

    return run


def torchjd_runner(aggregator: torch.nn.Module) -> Callable:
    """TorchJD returns only the direction; a forward hook on its weighting grabs the weights."""
    captured: dict[str, torch.Tensor] = {}

    def hook(_module: torch.nn.Module, _inputs: Any, output: torch.Tensor) -> None:
        captured["weights"] = output.detach()

    aggregator.gramian_weighting.register_forward_hook(hook)

    def run(stack: torch.Tensor) -> torch.Tensor:
        captured.clear()
        aggregator(stack)
        return captured["weights"].to(torch.float64)

    return run


def build_methods() -> tuple[list[Method], str | None]:
    """All compared calls with default settings; UPGrad of mogradient only if registered."""
    methods = [
        Method(PLAIN, "mgda", mogradient_runner(MGDA(False))),
        Method(TORCHJD_MGDA, "mgda", torchjd_runner(tja.MGDA())),
        Method(NORMALIZE, "mgda_normalized", mogradient_runner(MGDA())),
        Method("torchjd UPGrad()", "upgrad", torchjd_runner(tja.UPGrad())),
    ]
    upgrad = HARMONIZERS.get("upgrad")
    if upgrad is None:
        return methods, "mogradient has no 'upgrad' harmonizer registered: skipped"
    methods.insert(3, Method("mogradient UPGrad()", "upgrad", mogradient_runner(upgrad())))
    return methods, None


# ----------------------------------------------------------------------------- references


def exact_mgda(gram: np.ndarray) -> dict[str, Any]:
    """Best simplex-QP optimum over three independent solvers, evaluated on the float64 Gram."""
    objectives: dict[str, float | None] = {}
    errors: dict[str, str] = {}
    for backend in QP_BACKENDS:
        try:
            weights = solve_simplex_qp(gram, backend).weights
            objectives[backend] = float(weights @ gram @ weights)
        except Exception as error:  # a reference solver failing is reported, not fatal
            objectives[backend] = None
            errors[backend] = f"{type(error).__name__}: {error}"
    found = [value for value in objectives.values() if value is not None]
    return {"optimum": min(found), "per_backend": objectives, "errors": errors}


def exact_upgrad(gram: np.ndarray) -> dict[str, Any]:
    """Exact UPGrad weights: w = sum_i v_i, v_i = argmin v^T G v s.t. v >= e_i / K.

    Each projection QP is solved by cvxpy (Clarabel) and by quadprog; the feasible
    solution with the lower objective is kept and its KKT residual reported.
    """
    num_objectives = len(gram)
    normalized = gram / np.max(np.diag(gram))
    factor = _psd_factor(normalized)
    total = np.zeros(num_objectives)
    worst_kkt = 0.0
    for index in range(num_objectives):
        lower = np.zeros(num_objectives)
        lower[index] = 1.0 / num_objectives
        candidates = [_project_cvxpy(factor, lower), _project_quadprog(normalized, lower)]
        feasible = [np.maximum(found, lower) for found in candidates if found is not None]
        best = min(feasible, key=lambda vector: float(vector @ normalized @ vector))
        worst_kkt = max(worst_kkt, _projection_kkt(normalized, best, lower))
        total += best
    return {"weights": total, "kkt_residual": worst_kkt}


def torchjd_upgrad_on_gram(gram: np.ndarray, reg_eps: float) -> np.ndarray:
    """Independent check of the reference: TorchJD's UPGrad weighting, float64, tiny ridge."""
    from torchjd._linalg import QuadprogProjector

    weighting = tja.UPGradWeighting(projector=QuadprogProjector(reg_eps=reg_eps))
    return weighting(torch.from_numpy(gram)).numpy()


def _project_cvxpy(factor: np.ndarray, lower: np.ndarray) -> np.ndarray | None:
    import cvxpy as cp

    vector = cp.Variable(len(lower))
    problem = cp.Problem(cp.Minimize(cp.sum_squares(factor @ vector)), [vector >= lower])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "may be inaccurate": we keep the better solver
            problem.solve(solver=cp.CLARABEL, tol_gap_abs=1e-14, tol_gap_rel=1e-14, tol_feas=1e-14)
    except cp.error.SolverError:
        return None
    return None if vector.value is None else np.asarray(vector.value)


def _project_quadprog(gram: np.ndarray, lower: np.ndarray) -> np.ndarray | None:
    import qpsolvers

    hessian = 2.0 * gram + 1e-12 * np.eye(len(gram))
    try:
        return qpsolvers.solve_qp(hessian, np.zeros(len(gram)), lb=lower, solver="quadprog")
    except Exception:  # quadprog raises on a numerically singular Hessian
        return None


def _projection_kkt(gram: np.ndarray, vector: np.ndarray, lower: np.ndarray) -> float:
    """Violation of (G v >= 0, (G v)_k (v_k - l_k) = 0) for min v^T G v s.t. v >= l."""
    gradient = gram @ vector
    return float(max(np.max(-gradient, initial=0.0), np.max(np.abs(gradient * (vector - lower)))))


def _psd_factor(gram: np.ndarray) -> np.ndarray:
    eigenvalues, eigenvectors = np.linalg.eigh(0.5 * (gram + gram.T))
    return (eigenvectors * np.sqrt(np.clip(eigenvalues, 0.0, None))).T


# ----------------------------------------------------------------------------- scoring


def mgda_scores(weights: np.ndarray, gram: np.ndarray, optimum: float) -> dict[str, Any]:
    """Relative gap (f - f*)/f*, and the gap in units of max diag (safe when f* ~ 0).

    Weights are first put back on the simplex (float32 weights sum to 1 +- 1e-7, which
    alone moves f by ~1e-7 relative, even below f*); the violation is reported.
    """
    simplex_violation = abs(float(weights.sum()) - 1.0) + float(np.maximum(-weights, 0).sum())
    weights = np.maximum(weights, 0.0) / np.maximum(weights, 0.0).sum()
    value = float(weights @ gram @ weights)
    max_diag = float(np.max(np.diag(gram)))
    relative = (value - optimum) / optimum if optimum > 1e-12 * max_diag else None
    return {
        "objective": value,
        "relative_gap": relative,
        "gap_over_max_diag": (value - optimum) / max_diag,
        "simplex_violation": simplex_violation,
        "weights": weights.tolist(),
    }


def upgrad_scores(weights: np.ndarray, gram: np.ndarray, exact: np.ndarray) -> dict[str, Any]:
    """||J^T w - J^T w*|| / ||J^T w*|| and min_k cos(d, g_k), both through the float64 Gram."""
    difference = weights - exact
    distance = math.sqrt(max(float(difference @ gram @ difference), 0.0))
    reference_norm = math.sqrt(float(exact @ gram @ exact))
    direction_norm = math.sqrt(max(float(weights @ gram @ weights), 0.0))
    cosines = (gram @ weights) / (np.sqrt(np.diag(gram)) * max(direction_norm, 1e-300))
    return {
        "relative_distance": distance / reference_norm,
        "min_cosine": float(cosines.min()),
        "weights": weights.tolist(),
    }


# ----------------------------------------------------------------------------- one case


def run_case(case: Case, methods: list[Method]) -> dict[str, Any]:
    """Build the stack, score each method's first call, then time all interleaved."""
    started = time.perf_counter()
    stack = conflicting_stack(case.num_objectives, case.dim, case.seed)
    gram = float64_gram(stack)
    result: dict[str, Any] = {
        "num_objectives": case.num_objectives,
        "dim": case.dim,
        "seed": case.seed,
        "repeats": case.repeats,
        "diagnostics": stack_diagnostics(stack, gram),
    }
    mgda_ref = exact_mgda(gram)
    normalized_gram = gram / np.sqrt(np.outer(np.diag(gram), np.diag(gram)))
    normalized_ref = exact_mgda(normalized_gram)
    upgrad_ref = exact_upgrad(gram)
    cross_check = torchjd_upgrad_on_gram(gram, reg_eps=1e-10)
    result["reference"] = {
        "upgrad_vs_torchjd_reg1e-10_float64": upgrad_scores(
            cross_check, gram, upgrad_ref["weights"]
        )["relative_distance"],
        "mgda": mgda_ref,
        "mgda_normalized": normalized_ref,
        "upgrad_kkt_residual": upgrad_ref["kkt_residual"],
        "upgrad_weights": upgrad_ref["weights"].tolist(),
    }
    scored: dict[str, dict[str, Any]] = {}
    runnable: dict[str, Callable[[], Any]] = {}
    for method in methods:
        entry: dict[str, Any] = {"problem": method.problem}
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            weights = method.run(stack).numpy()
            first = {"wall": [time.perf_counter() - wall], "cpu": [time.process_time() - cpu]}
        except Exception as error:  # library failures are results, not crashes
            entry["error"] = f"{type(error).__name__}: {error}".strip()[:300]
            scored[method.label] = entry
            continue
        if method.problem == "mgda":
            entry.update(mgda_scores(weights, gram, mgda_ref["optimum"]))
        elif method.problem == "mgda_normalized":
            alpha = weights * np.sqrt(np.diag(gram))
            alpha /= alpha.sum()
            entry.update(mgda_scores(alpha, normalized_gram, normalized_ref["optimum"]))
        else:
            entry.update(upgrad_scores(weights, gram, upgrad_ref["weights"]))
        scored[method.label] = entry
        if first["wall"][0] > SLOW_CALL_S:  # keeps the run short; marked in the tables
            entry.update(timing_summary(first), single_call=True)
        else:
            runnable[method.label] = _bind(method.run, stack)
    floors = floor_functions(stack, torch.tensor(scored[PLAIN]["weights"]))
    timings = interleaved_times({**runnable, **floors}, case.repeats)
    for label, samples in timings.items():
        if label in scored:
            scored[label].update(timing_summary(samples))
    result["methods"] = scored
    result["floor"] = {label: timing_summary(timings[label]) for label in floors}
    result["case_seconds"] = time.perf_counter() - started
    del stack
    gc.collect()
    return result


def _bind(run: Callable[[torch.Tensor], torch.Tensor], stack: torch.Tensor) -> Callable:
    return lambda: run(stack)


def floor_functions(stack: torch.Tensor, weights: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """What the MGDA call is bounded by: reads of the stack, and each library's two passes.

    MGDA must read the stack twice (the Gram, then the direction once the weights are
    known). A read is ``stack.sum()``: every entry is loaded once and nothing is written,
    so it is the cheapest full pass there is. The direction pass also writes D entries.
    TorchJD's passes are the two lines its MGDA aggregator runs (one float32 matmul for
    the Gram, ``weights @ matrix`` for the direction).
    """
    finite = torch.ones(len(stack), dtype=torch.bool)
    narrowed = weights.to(stack.dtype)
    return {
        ONE_READ: lambda: stack.sum(),
        TWO_READS: lambda: (stack.sum(), stack.sum()),
        GRAM_ONLY: lambda: accumulate_gram(stack),
        DIRECTION_ONLY: lambda: combine(stack, weights, finite),
        THEIR_GRAM_ONLY: lambda: stack @ stack.T,
        THEIR_DIRECTION_ONLY: lambda: narrowed @ stack,
    }


# ----------------------------------------------------------------------------- stress stacks


def near_singular_stack(kind: str, num_objectives: int, dim: int, seed: int) -> torch.Tensor:
    """float64: an opposed pair (g, -c g + 1e-7 noise), near-duplicate pairs, or rank 2."""
    rng = np.random.default_rng(seed)
    stack = rng.standard_normal((num_objectives, dim))
    if kind == "opposed_pair":
        stack[1] = -rng.uniform(0.3, 3.0) * stack[0] + 1e-7 * rng.standard_normal(dim)
    elif kind == "near_duplicates":
        for index in range(1, num_objectives, 2):
            stack[index] = stack[index - 1] + 1e-7 * rng.standard_normal(dim)
    else:
        stack = rng.standard_normal((num_objectives, 2)) @ rng.standard_normal((2, dim))
    return torch.from_numpy(stack)


def spread_stack(
    num_objectives: int, dim: int, seed: int, exponents: tuple[float, float], dtype: torch.dtype
) -> torch.Tensor:
    """Gaussian directions with norms 10^e, e evenly spread over ``exponents``, rows shuffled."""
    rng = np.random.default_rng(seed)
    directions = rng.standard_normal((num_objectives, dim))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    norms = 10.0 ** np.linspace(*exponents, num_objectives)
    return torch.from_numpy(directions * rng.permutation(norms)[:, None]).to(dtype)


def simplex_minimum(cosines: np.ndarray) -> float:
    """min a^T C a over the simplex: the better of cvxpy (Clarabel) and quadprog.

    Each solver's point is put back on the simplex and evaluated on C. cvxpy alone is
    not enough: on opposed pairs (f* ~ 1e-15) Clarabel stops near f = 3e-8.
    """
    import cvxpy as cp
    import qpsolvers

    alpha = cp.Variable(len(cosines))
    problem = cp.Problem(
        cp.Minimize(cp.sum_squares(_psd_factor(cosines) @ alpha)), [alpha >= 0, cp.sum(alpha) == 1]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "may be inaccurate": the point is still evaluated
        problem.solve(solver=cp.CLARABEL, **STRESS_TIGHT)
    candidates = [alpha.value]
    with contextlib.suppress(Exception):  # quadprog raises on a numerically singular Hessian
        candidates.append(
            qpsolvers.solve_qp(
                2.0 * cosines + 1e-15 * np.eye(len(cosines)),
                np.zeros(len(cosines)),
                A=np.ones((1, len(cosines))),
                b=np.ones(1),
                lb=np.zeros(len(cosines)),
                solver="quadprog",
            )
        )
    values = []
    for found in candidates:
        if found is not None and np.all(np.isfinite(found)):
            point = np.maximum(np.asarray(found, dtype=np.float64), 0.0)
            point /= point.sum()
            values.append(float(point @ cosines @ point))
    return min(values)


def stress_record(stack: torch.Tensor, ours: MGDA, plain: MGDA, theirs: Callable) -> dict:
    """Gaps on the float64 cosine matrix C of the stack, and what each library dropped.

    mogradient's default MGDA() gets the raw stack (its normalize-rescale solves on C);
    plain MGDA of both libraries gets the unit-row stack in the stack's dtype, so all
    three solve the same problem. Weights are put back on the simplex before scoring.
    """
    values = stack.to(torch.float64)
    norms = torch.linalg.vector_norm(values, dim=1)
    unit = values / norms[:, None]
    cosines = (unit @ unit.T).numpy()
    optimum = simplex_minimum(cosines)
    record: dict[str, Any] = {"optimum": optimum}
    normalized = ours(stack)
    alpha = (normalized.weights * norms).numpy()
    record["normalize"] = _gap(alpha, cosines, optimum, len(normalized.dropped))
    unit_stack = unit.to(stack.dtype)
    plain_result = plain(unit_stack)
    record["plain_unit"] = _gap(
        plain_result.weights.numpy(), cosines, optimum, len(plain_result.dropped)
    )
    try:
        record["torchjd_unit"] = _gap(theirs(unit_stack).numpy(), cosines, optimum, 0)
    except Exception as error:  # a library failure is a result
        record["torchjd_unit"] = {"error": f"{type(error).__name__}: {error}"[:200]}
    return record


def _gap(alpha: np.ndarray, cosines: np.ndarray, optimum: float, dropped: int) -> dict:
    if not np.all(np.isfinite(alpha)):
        return {"error": "non-finite weights", "dropped": dropped}
    alpha = np.maximum(alpha, 0.0)
    alpha = alpha / alpha.sum()
    products = cosines @ alpha
    value = float(alpha @ products)
    return {
        "gap": value - optimum,
        "frank_wolfe_gap": 2.0 * (value - float(products.min())),
        "dropped": dropped,
        "alpha": alpha.tolist(),
    }


def stress_stacks(seeds: int) -> list[tuple[str, torch.Tensor, int]]:
    """(family, stack, seed) for every near-singular and scale-spread stack."""
    stacks = []
    for seed in range(seeds):
        for count in STRESS_COUNTS:
            for kind in NEAR_SINGULAR_KINDS:
                for dim in (6, 1000):
                    stacks.append((kind, near_singular_stack(kind, count, dim, seed), seed))
            for label, dtype, exponents in SPREADS:
                stacks.append((label, spread_stack(count, 1000, seed, exponents, dtype), seed))
    return stacks


def run_stress(seeds: int) -> list[dict[str, Any]]:
    """Score every stress stack; the stacks are small, so no timing here."""
    ours, plain = MGDA(), MGDA(normalize=False)
    theirs = torchjd_runner(tja.MGDA())
    records = []
    for family, stack, seed in stress_stacks(seeds):
        record = stress_record(stack, ours, plain, theirs)
        num_objectives, dim = stack.shape
        records.append(
            {
                "family": family,
                "dtype": str(stack.dtype).removeprefix("torch."),
                "seed": seed,
                "num_objectives": num_objectives,
                "dim": dim,
                **record,
            }
        )
    return records


# ----------------------------------------------------------------------------- report


def _fmt(value: float | None, spec: str = ".2e") -> str:
    return "n/a" if value is None else format(value, spec)


def _time(entry: dict[str, Any]) -> str:
    if "error" not in entry:
        wall, cpu = entry["median_ms"], entry["cpu_median_ms"]
        return f"{wall:.3g} ({cpu:.3g})" + (" 1 call" if entry.get("single_call") else "")
    return "not registered" if entry["error"] == "not registered" else "raised"


def _errors(ours: str, theirs: str) -> str:
    parts = [f"{who}: {text}" for who, text in (("mogradient", ours), ("TorchJD", theirs)) if text]
    return "; ".join(parts).replace("|", "/")[:160] or "-"


def mgda_table(results: list[dict[str, Any]]) -> str:
    header = [
        "K",
        "D",
        "mogradient plain ms",
        "TorchJD ms",
        "mogradient normalize ms",
        "mogradient rel gap",
        "TorchJD rel gap",
        "mogradient gap/maxdiag",
        "TorchJD gap/maxdiag",
        "normalize rel gap",
    ]
    rows = []
    for result in results:
        ours = result["methods"]["mogradient MGDA(normalize=False)"]
        theirs = result["methods"]["torchjd MGDA()"]
        normalized = result["methods"]["mogradient MGDA() [normalize]"]
        rows.append(
            [
                str(result["num_objectives"]),
                f"{result['dim']:.0e}",
                _time(ours),
                _time(theirs),
                _time(normalized),
                _fmt(ours.get("relative_gap")),
                _fmt(theirs.get("relative_gap")),
                _fmt(ours.get("gap_over_max_diag")),
                _fmt(theirs.get("gap_over_max_diag")),
                _fmt(normalized.get("relative_gap")),
            ]
        )
    return markdown_table(header, rows)


def speed_table(results: list[dict[str, Any]]) -> str:
    header = [
        "K",
        "D",
        "one read ms",
        "two reads ms",
        "our Gram ms",
        "our direction ms",
        "TorchJD Gram ms",
        "TorchJD direction ms",
        "mogradient MGDA() ms",
        "mogradient plain ms",
        "TorchJD ms",
        "MGDA() / TorchJD",
        "plain / TorchJD",
        "MGDA() / one read",
    ]
    rows = []
    for result in results:
        floor, methods = result["floor"], result["methods"]
        ours, plain, theirs = methods[NORMALIZE], methods[PLAIN], methods[TORCHJD_MGDA]
        read = floor[ONE_READ]["median_ms"]
        rows.append(
            [
                str(result["num_objectives"]),
                f"{result['dim']:.0e}",
                _time(floor[ONE_READ]),
                _time(floor[TWO_READS]),
                _time(floor[GRAM_ONLY]),
                _time(floor[DIRECTION_ONLY]),
                _time(floor[THEIR_GRAM_ONLY]),
                _time(floor[THEIR_DIRECTION_ONLY]),
                _time(ours),
                _time(plain),
                _time(theirs),
                f"{ours['median_ms'] / theirs['median_ms']:.2f}",
                f"{plain['median_ms'] / theirs['median_ms']:.2f}",
                f"{ours['median_ms'] / read:.2f}",
            ]
        )
    return markdown_table(header, rows)


def speed_headline(results: list[dict[str, Any]]) -> str:
    """The issue's target, K = 5, D = 2e7 float32: ours <= 0.3x TorchJD; and the floor."""
    found = [r for r in results if (r["num_objectives"], r["dim"]) == SPEED_CASE]
    if not found:
        return "The K = 5, D = 2e7 case is not part of this run (--quick)."
    result = found[0]
    read = result["floor"][ONE_READ]["median_ms"]
    two = result["floor"][TWO_READS]["median_ms"]
    theirs = result["methods"][TORCHJD_MGDA]["median_ms"]
    lines = [
        f"K = 5, D = 2e7 float32, median of {result['repeats']} interleaved rounds: "
        f"one read of the stack {read:.1f} ms, two reads {two:.1f} ms, "
        f"TorchJD MGDA() {theirs:.1f} ms."
    ]
    their_cpu = result["methods"][TORCHJD_MGDA]["cpu_median_ms"]
    their_fastest = result["methods"][TORCHJD_MGDA]["min_ms"]
    for label in (NORMALIZE, PLAIN):
        ours = result["methods"][label]["median_ms"]
        our_cpu = result["methods"][label]["cpu_median_ms"]
        our_fastest = result["methods"][label]["min_ms"]
        lines.append(
            f"- {label}: {ours:.1f} ms = {ours / theirs:.2f}x TorchJD "
            f"(target <= 0.30x), {ours / read:.2f}x one read, {ours / two:.2f}x two reads; "
            f"fastest rounds {our_fastest:.1f} vs {their_fastest:.1f} ms "
            f"= {our_fastest / their_fastest:.2f}x; process CPU {our_cpu:.0f} vs "
            f"{their_cpu:.0f} ms = {our_cpu / their_cpu:.2f}x."
        )
    passes = {label: result["floor"][label]["median_ms"] for label in result["floor"]}
    lines.append(
        f"- The passes alone: our Gram {passes[GRAM_ONLY]:.1f} ms and direction "
        f"{passes[DIRECTION_ONLY]:.1f} ms; TorchJD's Gram {passes[THEIR_GRAM_ONLY]:.1f} ms "
        f"and direction {passes[THEIR_DIRECTION_ONLY]:.1f} ms."
    )
    return "\n".join(lines)


STRESS_COLUMNS = (
    ("normalize", "mogradient MGDA() on raw stack"),
    ("plain_unit", "mogradient MGDA(normalize=False) on unit stack"),
    ("torchjd_unit", "TorchJD MGDA() on unit stack"),
)


def stress_table(records: list[dict[str, Any]]) -> str:
    """Worst gap and total drops per (family, dtype, K, D), over the seeds."""
    header = ["stacks", "dtype", "K", "D", "n"]
    for _, label in STRESS_COLUMNS:
        header += [f"{label}: max gap", "dropped"]
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for record in records:
        key = (record["family"], record["dtype"], record["num_objectives"], record["dim"])
        groups.setdefault(key, []).append(record)
    rows = []
    for (family, dtype, count, dim), members in groups.items():
        row = [family, dtype, str(count), str(dim), str(len(members))]
        for key, _ in STRESS_COLUMNS:
            row += _worst(members, key)
        rows.append(row)
    return markdown_table(header, rows)


def stress_headline(records: list[dict[str, Any]]) -> str:
    lines = []
    for key, label in STRESS_COLUMNS:
        scored = [r[key] for r in records if "gap" in r[key]]
        failed = len(records) - len(scored)
        dropped = sum(r[key].get("dropped", 0) for r in records)
        gap = max((entry["gap"] for entry in scored), default=None)
        certificate = max((entry["frank_wolfe_gap"] for entry in scored), default=None)
        lines.append(
            f"- {label}: worst gap {_fmt(gap)} (Frank-Wolfe certificate {_fmt(certificate)}) "
            f"over {len(scored)} stacks, {dropped} objectives dropped, {failed} failures."
        )
    return "\n".join(lines)


def _worst(members: list[dict[str, Any]], key: str) -> list[str]:
    entries = [member[key] for member in members]
    gaps = [entry["gap"] for entry in entries if "gap" in entry]
    failures = len(entries) - len(gaps)
    worst = _fmt(max(gaps)) if gaps else "n/a"
    if failures:
        worst += f" ({failures} failed)"
    return [worst, str(sum(entry.get("dropped", 0) for entry in entries))]


def upgrad_table(results: list[dict[str, Any]]) -> str:
    header = [
        "K",
        "D",
        "mogradient ms",
        "TorchJD ms",
        "mogradient rel dist",
        "TorchJD rel dist",
        "mogradient min cos",
        "TorchJD min cos",
        "errors",
    ]
    rows = []
    for result in results:
        ours = result["methods"].get("mogradient UPGrad()", {"error": "not registered"})
        ours_error = ours.get("error", "")
        theirs = result["methods"]["torchjd UPGrad()"]
        rows.append(
            [
                str(result["num_objectives"]),
                f"{result['dim']:.0e}",
                _time(ours),
                _time(theirs),
                _fmt(ours.get("relative_distance")),
                _fmt(theirs.get("relative_distance")),
                _fmt(ours.get("min_cosine"), ".3f"),
                _fmt(theirs.get("min_cosine"), ".3f"),
                _errors(ours_error, theirs.get("error", "")),
            ]
        )
    return markdown_table(header, rows)


def diagnostics_table(results: list[dict[str, Any]]) -> str:
    header = [
        "K",
        "D",
        "min pairwise cos",
        "conflicting pairs",
        "min eig/maxdiag (f64)",
        "min eig/maxdiag (f32 matmul)",
        "f32 Gram max err/maxdiag",
        "UPGrad ref KKT",
        "UPGrad ref vs TorchJD(reg 1e-10, f64)",
    ]
    rows = []
    for result in results:
        diag = result["diagnostics"]
        rows.append(
            [
                str(result["num_objectives"]),
                f"{result['dim']:.0e}",
                f"{diag['min_pairwise_cosine']:.3f}",
                f"{diag['conflicting_pairs_fraction']:.0%}",
                _fmt(diag["min_eig_over_max_diag_float64"]),
                _fmt(diag["min_eig_over_max_diag_float32"]),
                _fmt(diag["float32_gram_max_rel_error"]),
                _fmt(result["reference"]["upgrad_kkt_residual"]),
                _fmt(result["reference"]["upgrad_vs_torchjd_reg1e-10_float64"]),
            ]
        )
    return markdown_table(header, rows)


def markdown_report(payload: dict[str, Any]) -> str:
    results = payload["cases"]
    stress = payload["stress"]
    notes = f"\n\nNote: {payload['skipped']}" if payload["skipped"] else ""
    return f"""# MGDA and UPGrad: exactness and time, mogradient vs TorchJD

{machine_markdown(payload["machine"])}
Mode: {payload["mode"]}; total run time {payload["total_seconds"]:.0f} s.{notes}

## Speed: MGDA against TorchJD and against reading the stack

{speed_headline(results)}

MGDA reads the stack at least twice: once for the Gram, and once for the direction after
the weights are known. "One read" is `stack.sum()` (every entry loaded once, nothing
written); "two reads" calls it twice. "Our Gram" is `accumulate_gram(stack)` and "our
direction" `combine(stack, w)` alone; the direction pass also writes the D-entry result.
TorchJD's Gram and direction are the two lines its MGDA runs: `stack @ stack.T` (one
float32 matmul) and `w @ stack`. All columns are timed in the same interleaved rounds as
the methods below.

{speed_table(results)}

Caveat: on a shared machine, a parallel region (one matmul split over the torch threads)
waits whenever one of its threads is descheduled, typically a scheduler tick of several ms.
Code that runs many small parallel matmuls (a chunked Gram) suffers far more from this than
one large matmul; a CPU time close to the wall time with 2 threads is the sign. The raw
samples are in the JSON; `--threads 1` gives a contention-robust comparison.

## Stacks

{inspect.cleandoc(conflicting_stack.__doc__ or "").split(chr(10), 1)[1].strip()}

Seeds are fixed per case. Per-case diagnostics (cosines and eigenvalues from the float64 Gram;
"f32 matmul" is the single float32 `J @ J.T` that TorchJD computes):

{diagnostics_table(results)}

## Method

Both libraries receive the same float32 K x D stack with default settings; every timing is
the whole call (Gram from the stack, solve, combined direction). Times are medians over the
repeats listed in the JSON, with the methods interleaved in rotating order each round, shown
as "wall (process CPU)" in ms ("1 call": a call over {SLOW_CALL_S:.0f} s is timed once, by the
call that is scored, and not repeated); CPU time sums both threads, so on an idle machine it
is up to 2x the wall time, and it is the steadier number when other jobs share the cores.
Weights are read from each library (TorchJD via a forward hook on its weighting) and scored
on the float64 Gram (float64 accumulation over 1M-column chunks).

- MGDA: f(a) = ||sum a_k g_k||^2; f* = best of mogradient's builtin solver, cvxpy (Clarabel)
  and quadprog. rel gap = (f - f*)/f*; gap/maxdiag = (f - f*)/max_k ||g_k||^2. Library
  weights are put back on the simplex before scoring (TorchJD's float32 weights sum to
  1 +- 1e-7, which alone would move f by ~1e-7 relative, even below f*).
  "normalize" is mogradient's default MARBLE variant, scored on the unit-norm Gram.
- UPGrad: exact weights w* = sum_i v_i with v_i = argmin v^T G v s.t. v >= e_i/K, each QP
  solved by cvxpy and quadprog in float64 (the better kept; worst KKT residual in the table
  above). Independent check: TorchJD's own UPGrad weighting run on the float64 Gram with its
  ridge lowered from 1e-4 to 1e-10 lands within the last column's distance of w*.
  rel dist = ||J^T w - J^T w*|| / ||J^T w*||; min cos = min_k cos(J^T w, g_k), which UPGrad
  guarantees to be >= 0.

## MGDA (plain, un-normalized)

{mgda_table(results)}

## UPGrad

{upgrad_table(results)}

## MGDA on near-singular and scale-spread stacks

{stress_headline(stress)}

Stacks (seeds 0..{max(r["seed"] for r in stress)}, K = {", ".join(map(str, STRESS_COUNTS))}):
{inspect.getdoc(near_singular_stack)} D = 6 and 1000. Scale spread:
{inspect.getdoc(spread_stack)[0].lower()}{inspect.getdoc(spread_stack)[1:]} D = 1000.

Score: the gap a^T C a - min over the simplex of a^T C a, C the cosine matrix computed in
float64 from the stack (unit rows, then their products), the minimum being the better of
cvxpy (Clarabel, tolerances 1e-15) and quadprog, each point put back on the simplex and
evaluated on C (cvxpy alone stops at ~3e-8 on the opposed pairs, whose f* is ~1e-15).
A negative gap is a point below both references. The Frank-Wolfe certificate
2 (a^T C a - min_k (C a)_k) >= f(a) - f* needs no solver; its worst value is in the list.
TorchJD's MGDA is plain MGDA (its default Frank-Wolfe, epsilon 1e-3, 100 iterations),
which depends on the gradients' scale; to compare like with like, plain MGDA of both
libraries is run on the pre-normalized unit-row stack (in the stack's dtype), so it solves
the same problem as mogradient's default normalize-rescale on the raw stack. TorchJD
drops nothing (every objective enters its solve); "dropped" counts the objectives that
mogradient reported as unusable (only exactly-zero or non-finite gradients should be).

{stress_table(stress)}
"""


# ----------------------------------------------------------------------------- main


def cases_for(quick: bool) -> list[Case]:
    if quick:
        return [Case(k, 1_000_000, seed=k, repeats=3) for k in (2, 5)]
    return [
        Case(k, dim, seed=k + (0 if dim < 10**7 else 100), repeats=_repeats(k, dim))
        for dim in (1_000_000, 20_000_000)
        for k in (2, 5, 10)
    ]


def _repeats(num_objectives: int, dim: int) -> int:
    """More rounds for the headline case, whose ratio the issue sets a target on."""
    if (num_objectives, dim) == SPEED_CASE:
        return 21
    return 21 if dim < 10**7 else 9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="small subset for a smoke run")
    parser.add_argument("--out", type=Path, help="results folder (default: benchmarks/results)")
    parser.add_argument(
        "--threads", type=int, help="torch intra-op threads (results get a _threadsN suffix)"
    )
    args = parser.parse_args()
    name = NAME
    if args.threads:
        torch.set_num_threads(args.threads)
        name = f"{NAME}_threads{args.threads}"
    started = time.perf_counter()
    load_start = os.getloadavg()
    methods, skipped = build_methods()
    results = []
    for case in cases_for(args.quick):
        print(f"case K={case.num_objectives} D={case.dim:.0e} ...", flush=True)
        results.append(run_case(case, methods))
    print("near-singular and scale-spread stacks ...", flush=True)
    stress = run_stress(seeds=1 if args.quick else 3)
    payload = {
        "machine": {**machine_info(), "loadavg_1_5_15_start": load_start},
        "mode": "quick" if args.quick else "full",
        "skipped": skipped,
        "cases": results,
        "stress": stress,
        "total_seconds": time.perf_counter() - started,
    }
    print("\nSpeed\n" + speed_headline(results) + "\n" + speed_table(results))
    print("\nMGDA\n" + mgda_table(results) + "\n\nUPGrad\n" + upgrad_table(results))
    print("\nStress stacks\n" + stress_headline(stress) + "\n" + stress_table(stress))
    if args.out is not None or not args.quick:  # a smoke run never replaces results
        json_path, md_path = write_results(name, payload, markdown_report(payload), args.out)
        print(f"\nwrote {json_path} and {md_path} ({payload['total_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
