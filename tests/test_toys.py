"""Toy problems: values by hand, exact Pareto sets, stationarity test, the optimization loop."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.toys.problems import (
    LITERATURE_FRONT_X2,
    LOWER,
    STANDARD_STARTS,
    cagrad_front,
    cagrad_objectives,
    cagrad_toy,
    convex_quadratics,
    is_pareto_stationary,
    optimize,
    optimize_starts,
    pareto_stationarity,
    quadratic_pareto_point,
    triangle_quadratics,
)
from mogradient import make_harmonizer
from mogradient.harmonizers import MGDA


def point(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_toy_is_zero_where_both_gates_close() -> None:
    # c1 = max(tanh(0), 0) = 0 and c2 = max(tanh(-0), 0) = 0.
    assert cagrad_objectives(point(0.0, 0.0)).tolist() == [0.0, 0.0]


def test_toy_below_the_axis_is_the_gated_quadratic() -> None:
    # x = (7, -8): f1_sq = (0 + 0)/10 - 20, f2_sq = (14^2 + 0)/10 - 20 = -0.4, c2 = tanh(4).
    gate = math.tanh(4.0)
    expected = [-20.0 * gate, -0.4 * gate]
    assert cagrad_objectives(point(7.0, -8.0)).tolist() == pytest.approx(expected, rel=1e-12)


def test_toy_above_the_axis_is_the_gated_log_valley() -> None:
    # x = (-7, 2): |0.5*0 - tanh(-2)| = tanh 2 and |0.5*10 + tanh(-2) + 2| = 7 - tanh 2.
    gate = math.tanh(1.0)
    expected = [
        gate * (math.log(math.tanh(2.0)) + 6),
        gate * (math.log(7 - math.tanh(2.0)) + 6),
    ]
    assert cagrad_objectives(point(-7.0, 2.0)).tolist() == pytest.approx(expected, rel=1e-12)


def test_toy_log_is_floored_at_lower_in_the_valley() -> None:
    # On x1 = -7 + 2 tanh(x2) the first logarithm's argument vanishes.
    x2 = 2.0
    value = cagrad_objectives(point(-7.0 + 2.0 * math.tanh(x2), x2))[0]
    assert float(value) == pytest.approx(math.tanh(1.0) * (math.log(LOWER) + 6), rel=1e-12)


def test_nash_scaling_multiplies_only_the_first_loss_by_a_tenth() -> None:
    x = point(1.5, -3.0)
    plain, scaled = cagrad_objectives(x), cagrad_objectives(x, nash_scaling=True)
    assert scaled.tolist() == pytest.approx([0.1 * float(plain[0]), float(plain[1])], rel=1e-12)


def test_batched_jacobian_matches_autograd_per_point() -> None:
    problem = cagrad_toy()
    points = torch.tensor(STANDARD_STARTS, dtype=torch.float64) + 0.3
    losses, jacobians = problem.jacobian(points)
    assert jacobians.shape == (5, 2, 2)
    for x, value, jacobian in zip(points, losses, jacobians, strict=True):
        expected = torch.autograd.functional.jacobian(problem.losses, x)
        torch.testing.assert_close(jacobian, expected)
        torch.testing.assert_close(value, problem.losses(x))


def test_front_matches_the_literature_line_at_its_centre_and_dips_at_the_ends() -> None:
    front = cagrad_front(5)
    assert front[:, 0].tolist() == [-7.0, -3.5, 0.0, 3.5, 7.0]
    assert float(front[2, 1]) == pytest.approx(LITERATURE_FRONT_X2, abs=2e-4)
    assert float(front[0, 1]) == pytest.approx(-8.4345, abs=1e-4)
    assert torch.allclose(front[:, 1], front.flip(0)[:, 1])


def test_front_points_are_pareto_stationary_and_others_are_not() -> None:
    problem = cagrad_toy()
    _, on_front = problem.jacobian(cagrad_front(41))
    assert all(is_pareto_stationary(jacobian) for jacobian in on_front)
    for x in [
        point(3.0, -5.0),
        point(0.0, -9.5),
        point(8.0, -8.4),
        point(0.0, LITERATURE_FRONT_X2 - 0.2),
    ]:
        _, jacobian = problem.jacobian(x)
        assert pareto_stationarity(jacobian) > 1e-3, x


def test_front_distance_is_zero_on_the_front_and_euclidean_off_it() -> None:
    problem = cagrad_toy()
    assert problem.front_distance(cagrad_front(3)[1]) == pytest.approx(0.0, abs=1e-9)
    assert problem.front_distance(point(0.0, -5.0)) == pytest.approx(8.3551 - 5.0, abs=1e-3)


def test_mgda_from_a_standard_start_moves_toward_the_front() -> None:
    problem = cagrad_toy()
    run = optimize(problem, MGDA(), (-7.5, -0.5), steps=300, lr=1e-2)
    before = problem.front_distance(run.positions[0])
    after = problem.front_distance(run.final_position)
    assert after < before - 2.0
    # MGDA's step never works against an objective: every worst cosine is >= 0.
    assert float(run.cos_min().min()) >= -1e-9
    assert (run.losses[-1] < run.losses[0]).all()


def test_trajectory_shapes_and_records() -> None:
    problem = triangle_quadratics()
    run = optimize(problem, make_harmonizer("mean"), problem.starts[0], steps=7, lr=0.1)
    assert run.positions.shape == (8, 2)
    assert run.losses.shape == (8, 3)
    assert run.weights.shape == (7, 3)
    assert len(run.diagnostics) == 7
    assert math.isfinite(run.seconds_per_step) and math.isfinite(run.harmonizer_seconds)
    torch.testing.assert_close(run.losses[-1], problem.losses(run.final_position))


def test_batched_starts_equal_separate_runs() -> None:
    problem = cagrad_toy()
    batched = optimize_starts(problem, MGDA, STANDARD_STARTS, steps=25, lr=1e-2)
    for start, run in zip(STANDARD_STARTS, batched, strict=True):
        single = optimize(problem, MGDA(), start, steps=25, lr=1e-2)
        torch.testing.assert_close(run.positions, single.positions, rtol=0, atol=0)
        torch.testing.assert_close(run.weights, single.weights, rtol=0, atol=0)


def test_zero_steps_returns_the_start() -> None:
    problem = cagrad_toy()
    run = optimize(problem, MGDA(), (1.0, 2.0), steps=0)
    assert run.positions.tolist() == [[1.0, 2.0]]
    assert run.weights.shape == (0, 2)


@pytest.mark.parametrize(
    ("start", "options", "message"),
    [
        ((1.0, 2.0, 3.0), {}, "dimension 2"),
        ((1.0, 2.0), {"optimizer": "lbfgs"}, "unknown optimizer"),
        ((1.0, 2.0), {"steps": -1}, "steps"),
        ((1.0, 2.0), {"lr": 0.0}, "lr"),
    ],
)
def test_optimize_rejects_bad_arguments(start: tuple, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        optimize(cagrad_toy(), MGDA(), start, **options)


def test_quadratic_pareto_points_are_stationary_for_anisotropic_bowls() -> None:
    generator = torch.Generator().manual_seed(0)
    centers = torch.randn(3, 4, generator=generator, dtype=torch.float64)
    factors = torch.randn(3, 4, 4, generator=generator, dtype=torch.float64)
    matrices = factors @ factors.mT + 0.5 * torch.eye(4, dtype=torch.float64)
    problem = convex_quadratics(centers, matrices)
    assert problem.front_distance is None
    weights = torch.softmax(torch.randn(6, 3, generator=generator, dtype=torch.float64), dim=1)
    _, jacobians = problem.jacobian(quadratic_pareto_point(centers, matrices, weights))
    assert all(pareto_stationarity(jacobian) < 1e-6 for jacobian in jacobians)
    _, away = problem.jacobian(centers.mean(dim=0) + 10.0)
    assert not is_pareto_stationary(away)


def test_isotropic_quadratics_have_the_hull_as_pareto_set() -> None:
    problem = triangle_quadratics()
    inside = point(0.0, 1.0)
    assert problem.front_distance(inside) == pytest.approx(0.0, abs=1e-6)
    assert is_pareto_stationary(problem.jacobian(inside)[1])
    # Straight below the base edge (y = 0, |x| <= 4): the distance is |y|.
    assert problem.front_distance(point(1.0, -3.0)) == pytest.approx(3.0, rel=1e-10)
    assert not is_pareto_stationary(problem.jacobian(point(1.0, -3.0))[1])
    # The sampled Pareto set contains the centres (the simplex vertices).
    for center in [(-4.0, 0.0), (4.0, 0.0), (0.0, 5.0)]:
        assert torch.cdist(point(*center)[None], problem.front).min() < 1e-12


def test_quadratic_values_by_hand() -> None:
    problem = convex_quadratics(
        [[0.0, 0.0], [2.0, 0.0]], [[[1.0, 0.0], [0.0, 1.0]], [[2.0, 0.0], [0.0, 4.0]]]
    )
    # f1 = 1/2 (1 + 1) = 1; f2 = 1/2 (2 * 1 + 4 * 1) = 3 at x = (1, 1).
    assert problem.losses(point(1.0, 1.0)).tolist() == pytest.approx([1.0, 3.0])


def test_quadratics_reject_bad_matrices() -> None:
    with pytest.raises(ValueError, match="positive definite"):
        convex_quadratics([[0.0], [1.0]], [[[1.0]], [[-1.0]]])
    with pytest.raises(ValueError, match="one 2 x 2 matrix per center"):
        convex_quadratics([[0.0, 0.0], [1.0, 0.0]], [[[1.0]], [[1.0]]])


def test_stationarity_of_all_zero_gradients_is_zero() -> None:
    assert pareto_stationarity(torch.zeros(3, 2)) == 0.0
