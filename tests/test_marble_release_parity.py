"""tools/marble_release_parity.py: its --quick run, and its copy of the MARBLE release's
balancer checked rule by rule against computations that do not go through it.

The release (aim-uofa/MARBLE @1bf9543, flow_grpo/pareto_balancer): valid = finite and raw
norm > 1e-12; unit vectors times the reward weights; SLSQP on their float32 Gram with
bounds (floor, None), floor K > 1 -> 1/K; a failed SLSQP iterate is still used, clipped to
the floor, unless it sums below 1e-8; no valid vector -> zero direction, one -> its raw
gradient, a solver error -> the mean unit vector; the direction is rescaled by the mean
raw norm of the valid vectors.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("scipy")

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "marble_release_parity.py"
RESULTS = ROOT / "benchmarks" / "results"


def _load_tool():
    spec = importlib.util.spec_from_file_location("marble_release_parity", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


tool = _load_tool()


# ----------------------------------------------------------------------------- the --quick run


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> dict:
    pytest.importorskip("cvxpy")
    pytest.importorskip("qpsolvers")
    out = tmp_path_factory.mktemp("parity")
    committed = {
        path: path.stat().st_mtime_ns for path in RESULTS.glob(f"{tool.NAME}.*") if path.is_file()
    }
    result = subprocess.run(
        [sys.executable, str(TOOL), "--quick", "--out", str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert {path: path.stat().st_mtime_ns for path in committed} == committed
    markdown = (out / f"{tool.NAME}.md").read_text()
    assert markdown.startswith("# The MARBLE release's balancer vs our MGDA")
    assert "The issue's claims, and what this run measured" in markdown
    return json.loads((out / f"{tool.NAME}.json").read_text())


@pytest.mark.slow
def test_quick_run_has_every_part(quick: dict) -> None:
    assert quick["mode"] == "quick"
    assert {"cpu_model", "versions", "date"} <= set(quick["machine"])
    assert {"scipy", "cvxpy", "qpsolvers"} <= set(quick["versions"])
    groups = {case["group"] for case in quick["cases"]}
    assert groups == {"accuracy", "options", "timing"}
    for case in quick["cases"]:
        for name in ("release", "ours"):
            side = case[name]
            assert {"alpha", "gap", "kkt", "own_gram_gap", "time"} <= set(side)
            assert side["time"]["median_ms"] > 0
            assert len(side["alpha"]) == case["num_objectives"]
        assert case["time_ratio_release_over_ours"]["of_medians"] > 0
    summary = quick["summary"]
    assert summary["cases"] == sum(case["group"] != "timing" for case in quick["cases"])
    assert {"release_all", "ours_float64", "timing"} <= set(summary)
    assert [edge["label"] for edge in quick["edges"]] == [label for label, _ in tool.edge_stacks()]


@pytest.mark.slow
def test_quick_run_invariants(quick: dict) -> None:
    """The exact reference is never beaten; both methods solve the same problem."""
    for case in quick["cases"]:
        optimum = case["reference"]["objective"]
        for name in ("release", "ours"):
            side = case[name]
            # The reference is the minimum: no feasible point lies (measurably) below it.
            assert side["objective"] >= optimum - 1e-12, (case["label"], name)
            assert side["gap"] >= -1e-12
            assert side["infeasibility"] <= 1e-6  # the release's alpha is float32
            assert min(side["alpha"]) >= case["effective_floor"] - 1e-7
        # Both sides land near the same optimum (SLSQP's ftol is 1e-8).
        assert case["release"]["gap"] <= 1e-6
        assert case["alpha_max_abs_diff"] <= 1e-3
        if case["dtype"] == "float64":  # ours is exact on a float64 stack
            assert case["ours"]["gap"] <= 1e-12
            assert case["ours"]["kkt"] <= 1e-12
        if case["family"] == "opposed":  # g and -c g: zero is in the hull
            assert optimum <= 1e-12
            assert not case["direction_defined"]
        if case["direction_defined"]:
            assert case["cos_release_ours"] >= 0.9999
    gaussian = [
        case
        for case in quick["cases"]
        if case["family"] == "gaussian" and case["dtype"] == "float64"
    ]
    assert gaussian and all(case["cos_release_ours"] >= 0.99999 for case in gaussian)
    edges = {edge["label"]: edge for edge in quick["edges"]}
    assert edges["one row of norm 1e-13"]["release_alphas"][1] == 0.0  # invalid for the release
    assert edges["one row of norm 1e-13"]["ours_dropped"] == []  # usable for ours
    assert edges["all rows zero"]["release_reason"] == "all_zero"
    assert edges["only one nonzero row"]["release_reason"] == "single_valid"


# ----------------------------------------------------------------------------- the release's rules


def _two_point_alpha(cosine: float, weights: tuple[float, float], floor: float) -> float:
    """alpha_1 of min ||a v_1 u_1 + (1 - a) v_2 u_2||^2 over a in [floor, 1 - floor]."""
    first, second = weights
    cross = first * second * cosine
    free = (second**2 - cross) / (first**2 + second**2 - 2 * cross)
    return min(max(free, floor), 1.0 - floor)


@pytest.mark.parametrize("floor", [0.0, 0.2, 0.45])
def test_floor_is_a_bound_inside_the_qp(floor: float) -> None:
    """K = 2, reward weights (1, 3), cos 0.5: the free optimum is a = 1 (outside the
    simplex's interior); the floor clips it to 1 - floor, as the 1-D closed form says."""
    vectors = [
        torch.tensor([1.0, 0.0], dtype=torch.float64),
        7.0 * torch.tensor([0.5, 0.75**0.5], dtype=torch.float64),
    ]
    result = tool.release_balance(vectors, reward_weights=[1.0, 3.0], alpha_floor=floor)
    expected = _two_point_alpha(0.5, (1.0, 3.0), floor)
    assert result.reason == "none"
    assert result.alphas.dtype == torch.float32
    assert math.isclose(float(result.alphas[0]), expected, abs_tol=1e-6)
    assert math.isclose(float(result.alphas.sum()), 1.0, abs_tol=1e-6)


def test_floor_above_one_over_k_means_uniform_and_negative_means_zero() -> None:
    rng = np.random.default_rng(3)
    vectors = list(torch.from_numpy(rng.standard_normal((3, 50))))
    uniform = tool.release_balance(vectors, alpha_floor=0.4)
    assert uniform.solver["floor"] == pytest.approx(1 / 3)
    assert torch.allclose(uniform.alphas, torch.full((3,), 1 / 3), atol=1e-7)
    negative = tool.release_balance(vectors, alpha_floor=-0.3)
    plain = tool.release_balance(vectors)
    assert negative.solver["floor"] == 0.0
    assert torch.equal(negative.alphas, plain.alphas)


def test_single_valid_vector_is_returned_raw() -> None:
    """One valid vector beside a zero one, one of norm 1e-13 and one holding a NaN."""
    rng = np.random.default_rng(5)
    only = torch.from_numpy(rng.standard_normal(40)) * 1e3
    tiny = torch.from_numpy(rng.standard_normal(40))
    tiny *= 1e-13 / tiny.norm()
    broken = torch.ones(40, dtype=torch.float64)
    broken[7] = float("nan")
    result = tool.release_balance([torch.zeros(40, dtype=torch.float64), only, tiny, broken])
    assert result.reason == "single_valid"
    assert result.valid.tolist() == [False, True, False, False]
    assert torch.equal(result.direction, only)  # not normalized, not rescaled
    assert result.direction.data_ptr() != only.data_ptr()  # a copy
    assert result.alphas.tolist() == [0.0, 1.0, 0.0, 0.0]
    assert result.rescale == float(only.norm().to(torch.float32))


def test_no_valid_vector_gives_a_zero_direction() -> None:
    vectors = [torch.zeros(6), torch.full((6,), 1e-14), torch.full((6,), float("inf"))]
    result = tool.release_balance(vectors)
    assert result.reason == "all_zero"
    assert torch.equal(result.direction, torch.zeros(6))
    assert torch.equal(result.alphas, torch.zeros(3))


@pytest.mark.parametrize("weights", [None, (1.0, 2.0)])
def test_rescale_by_the_mean_raw_norm(weights: tuple[float, float] | None) -> None:
    """Orthogonal g_1 = 3 e_1, g_2 = 4 e_2: the min-norm point of {v_1 e_1, v_2 e_2} has
    a_1 = v_2^2 / (v_1^2 + v_2^2), and d = 3.5 (a_1 v_1 e_1 + a_2 v_2 e_2)."""
    vectors = [torch.tensor([3.0, 0.0, 0.0]), torch.tensor([0.0, 4.0, 0.0])]
    first, second = weights or (1.0, 1.0)
    share = second**2 / (first**2 + second**2)
    result = tool.release_balance(vectors, reward_weights=weights)
    assert result.rescale == 3.5
    expected = 3.5 * torch.tensor([share * first, (1 - share) * second, 0.0])
    assert torch.allclose(result.direction, expected, atol=1e-5)
    assert result.direction.dtype == torch.float32


def test_direction_is_mean_norm_times_weighted_unit_sum() -> None:
    """On a random float64 stack the direction is m sum a_k u_k for the returned alphas,
    m the mean norm: computed here independently, in float64."""
    rng = np.random.default_rng(9)
    stack = torch.from_numpy(rng.standard_normal((4, 300)) * [[1e-3], [1.0], [10.0], [1e3]])
    result = tool.release_balance(list(stack))
    norms = stack.norm(dim=1)
    expected = norms.mean() * (result.alphas.to(torch.float64) @ (stack / norms[:, None]))
    assert result.rescale == pytest.approx(float(norms.mean()), rel=1e-6)
    assert torch.allclose(result.direction, expected, rtol=1e-6, atol=0.0)


def test_solver_error_falls_back_to_the_mean_unit_vector() -> None:
    def failing(*_args: object) -> torch.Tensor:
        raise RuntimeError("no solution")

    vectors = [
        torch.tensor([2.0, 0.0], dtype=torch.float64),
        torch.zeros(2, dtype=torch.float64),
        torch.tensor([0.0, 6.0], dtype=torch.float64),
    ]
    result = tool.release_balance(vectors, reward_weights=[1.0, 5.0, 3.0], solve=failing)
    assert result.reason == "solver_failed"
    assert result.alphas.tolist() == [0.5, 0.0, 0.5]
    # mean of the weighted unit vectors e_1 and 3 e_2, times the mean norm 4
    assert torch.allclose(result.direction, torch.tensor([2.0, 6.0], dtype=torch.float64))


def test_failed_slsqp_iterate_is_clipped_and_used_unless_it_vanishes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    units = [torch.eye(3, dtype=torch.float64)[index] for index in range(3)]

    def failed_at(point: list[float]):
        def minimize(*_args: object, **_kwargs: object) -> SimpleNamespace:
            return SimpleNamespace(x=np.array(point), success=False, nit=500, message="limit")

        return minimize

    monkeypatch.setattr(tool.optimize, "minimize", failed_at([0.6, -0.2, 0.2]))
    alphas = tool.release_simplex_weights(units)
    assert torch.allclose(alphas, torch.tensor([0.75, 0.0, 0.25]))
    monkeypatch.setattr(tool.optimize, "minimize", failed_at([1e-9, -1.0, 0.0]))
    with pytest.raises(RuntimeError):
        tool.release_simplex_weights(units)
    result = tool.release_balance(units)
    assert result.reason == "solver_failed"
    assert torch.allclose(result.alphas, torch.full((3,), 1 / 3))


def test_single_objective_solve_is_one() -> None:
    assert tool.release_simplex_weights([torch.ones(4)]).tolist() == [1.0]


# ----------------------------------------------------------------------------- the reference


def test_reference_solvers_agree_and_kkt_vanishes_at_the_optimum() -> None:
    pytest.importorskip("cvxpy")
    pytest.importorskip("qpsolvers")
    for family in ("conflicting", "near_duplicate", "rank_deficient"):
        stack = tool.make_stack(family, 5, 200, 0, torch.float64)
        gram = tool.unit_gram(stack)
        for floor in (0.0, 0.1):
            reference = tool.reference_qp(gram, floor)
            values = [value for value in reference["per_solver"].values() if value is not None]
            assert len(values) >= 2
            assert max(values) - min(values) <= 1e-8, (family, floor, reference["per_solver"])
            assert tool.kkt_residual(gram, reference["weights"], floor) <= 1e-10
            uniform = np.full(5, 0.2)
            if float(uniform @ gram @ uniform) > reference["objective"] + 1e-6:
                assert tool.kkt_residual(gram, uniform, floor) > 1e-6
