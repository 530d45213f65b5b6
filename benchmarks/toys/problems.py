"""Analytic toy problems with known Pareto sets, and a plain harmonized optimization loop.

They make a harmonizer's behaviour visible in seconds: whether it reaches the Pareto
front, where on the front it lands, and how much its steps conflict with each objective.
Objectives are written for batched inputs (``x[..., D] -> losses[..., K]``) so that a
whole Jacobian costs one forward and one backward pass.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from mogradient._gram import gram_matrix
from mogradient._qp import solve_simplex_qp
from mogradient.diagnostics import conflict_diagnostics
from mogradient.engines import write_gradient
from mogradient.harmonizers import Harmonizer

LOWER = 5e-6
"""Floor inside the logarithms of the CAGrad toy (keeps the valleys finite)."""

LITERATURE_FRONT_X2 = -8.3552
"""The front's x2 as the papers draw it (a horizontal line); exact only at x1 = 0."""

FRONT_X1_RANGE = (-7.0, 7.0)

STANDARD_STARTS: tuple[tuple[float, float], ...] = (
    (-8.5, 7.5),
    (0.0, 0.0),
    (9.0, 9.0),
    (-7.5, -0.5),
    (9.0, -1.0),
)
"""The five initial points of CAGrad (Liu et al. 2021) and Nash-MTL (Navon et al. 2022)."""

DTYPE = torch.float64


@dataclass(frozen=True, eq=False)
class ToyProblem:
    """K differentiable objectives of a D-dimensional point, with what is known about them.

    ``objectives`` maps ``x[..., D]`` to ``losses[..., K]``. ``front`` samples the Pareto
    set (for drawing); ``front_distance`` is the Euclidean distance of a point to it, when
    that is known exactly.
    """

    name: str
    dimension: int
    num_objectives: int
    objectives: Callable[[torch.Tensor], torch.Tensor]
    starts: tuple[tuple[float, ...], ...]
    front: torch.Tensor | None = None
    front_distance: Callable[[torch.Tensor], float] | None = None

    def losses(self, x: torch.Tensor) -> torch.Tensor:
        """The K losses at ``x`` (differentiable)."""
        return self.objectives(x)

    def jacobian(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Losses ``[..., K]`` at ``x[..., D]`` and the Jacobians ``[..., K, D]``, one backward.

        Objective k is evaluated on its own copy of each point, so the gradient of the sum of
        the diagonals with respect to the copies holds every Jacobian, row by row.
        """
        x = x.detach().to(DTYPE)
        shape = (*x.shape[:-1], self.num_objectives, self.dimension)
        copies = x.unsqueeze(-2).expand(shape).clone().requires_grad_(True)
        own = self.objectives(copies).diagonal(dim1=-2, dim2=-1)
        (jacobian,) = torch.autograd.grad(own.sum(), copies)
        return own.detach(), jacobian


def cagrad_objectives(x: torch.Tensor, nash_scaling: bool = False) -> torch.Tensor:
    """The two objectives of the CAGrad / Nash-MTL toy at ``x[..., 2]``.

    Above x2 = 0 each loss is a log-valley (hard to leave), below it a quadratic bowl;
    the gates ``tanh(+-x2/2)`` blend the two. Nash-MTL scales L1 by 0.1.
    """
    x1, x2 = x[..., 0], x[..., 1]
    f1 = torch.log(torch.clamp(torch.abs(0.5 * (-x1 - 7) - torch.tanh(-x2)), min=LOWER)) + 6
    f2 = torch.log(torch.clamp(torch.abs(0.5 * (-x1 + 3) + torch.tanh(-x2) + 2), min=LOWER)) + 6
    c1 = torch.clamp(torch.tanh(x2 / 2), min=0)
    c2 = torch.clamp(torch.tanh(-x2 / 2), min=0)
    f1_sq = ((-x1 + 7) ** 2 + 0.1 * (-x2 - 8) ** 2) / 10 - 20
    f2_sq = ((-x1 - 7) ** 2 + 0.1 * (-x2 - 8) ** 2) / 10 - 20
    first = f1 * c1 + f1_sq * c2
    second = f2 * c1 + f2_sq * c2
    if nash_scaling:
        first = 0.1 * first
    return torch.stack([first, second], dim=-1)


def cagrad_front(num_points: int = 2001) -> torch.Tensor:
    """Points (x1, x2) of the toy's exact Pareto front, x1 evenly spaced over [-7, 7].

    On the front the convex combination (a, 1-a), a = (x1 + 7) / 14, of the two gradients
    cancels in x1; x2 then solves c2'(x2) S(x1, x2) + c2(x2) 0.02 (x2 + 8) = 0 with
    S = a f1_sq + (1-a) f2_sq. We solve it by bisection: x2 runs from -8.3551 (x1 = 0)
    to -8.4345 (x1 = +-7), so the papers' line x2 = -8.3552 is off by up to 0.08.
    """
    x1 = torch.linspace(*FRONT_X1_RANGE, num_points, dtype=DTYPE)
    low = torch.full_like(x1, -9.5)
    high = torch.full_like(x1, -8.0)
    for _ in range(60):
        middle = 0.5 * (low + high)
        positive = _front_condition(x1, middle) > 0
        low = torch.where(positive, low, middle)
        high = torch.where(positive, middle, high)
    return torch.stack([x1, 0.5 * (low + high)], dim=1)


def _front_condition(x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """Stationarity in x2 of the front's convex combination; negative below the front."""
    gate = torch.tanh(-x2 / 2)
    gate_slope = -0.5 * (1 - gate**2)
    combined = ((49 - x1**2) + 0.1 * (x2 + 8) ** 2) / 10 - 20
    return gate_slope * combined + gate * 0.02 * (x2 + 8)


def cagrad_toy(nash_scaling: bool = False) -> ToyProblem:
    """The 2-D two-objective toy of CAGrad (and Nash-MTL with ``nash_scaling=True``)."""
    front = cagrad_front()
    name = "nashmtl_toy" if nash_scaling else "cagrad_toy"
    return ToyProblem(
        name=name,
        dimension=2,
        num_objectives=2,
        objectives=lambda x: cagrad_objectives(x, nash_scaling),
        starts=STANDARD_STARTS,
        front=front,
        front_distance=lambda x: _distance_to_points(x, front),
    )


def _distance_to_points(x: torch.Tensor, points: torch.Tensor) -> float:
    return float(torch.cdist(x.detach().to(DTYPE).reshape(1, -1), points).min())


def convex_quadratics(
    centers: Sequence[Sequence[float]] | torch.Tensor,
    matrices: Sequence[Sequence[Sequence[float]]] | torch.Tensor | None = None,
    starts: Sequence[Sequence[float]] = (),
    name: str = "quadratics",
) -> ToyProblem:
    """f_k(x) = 1/2 (x - c_k)^T A_k (x - c_k), with A_k = I unless ``matrices`` are given.

    Every Pareto-stationary point is :func:`quadratic_pareto_point` of some simplex
    weights, so ``front`` samples it. With A_k = I the Pareto set is the convex hull of
    the centers and the distance to it is exact (a simplex QP).
    """
    centers = torch.as_tensor(centers, dtype=DTYPE)
    if centers.ndim != 2 or len(centers) < 2:
        raise ValueError(f"centers must be a K x D array with K >= 2, got {tuple(centers.shape)}")
    count, dimension = centers.shape
    identity = matrices is None
    matrices = _checked_matrices(matrices, count, dimension)

    def objectives(x: torch.Tensor) -> torch.Tensor:
        offsets = x.unsqueeze(-2) - centers
        return 0.5 * torch.einsum("...ki,kij,...kj->...k", offsets, matrices, offsets)

    return ToyProblem(
        name=name,
        dimension=dimension,
        num_objectives=count,
        objectives=objectives,
        starts=tuple(tuple(float(value) for value in start) for start in starts),
        front=_sampled_pareto_set(centers, matrices),
        front_distance=(lambda x: _distance_to_hull(x, centers)) if identity else None,
    )


def triangle_quadratics() -> ToyProblem:
    """Three isotropic bowls centred on a triangle: the Pareto set is the triangle itself.

    Outside it the gradients agree; on reaching it they start to conflict, so methods
    differ in where on the set they stop. Starts lie outside, on every side.
    """
    return convex_quadratics(
        centers=[(-4.0, 0.0), (4.0, 0.0), (0.0, 5.0)],
        starts=[(-8.0, -5.0), (8.0, -4.0), (0.0, 9.0), (8.0, 6.0)],
        name="triangle_quadratics",
    )


def _checked_matrices(
    matrices: Sequence[Sequence[Sequence[float]]] | torch.Tensor | None, count: int, dimension: int
) -> torch.Tensor:
    if matrices is None:
        return torch.eye(dimension, dtype=DTYPE).expand(count, dimension, dimension)
    matrices = torch.as_tensor(matrices, dtype=DTYPE)
    if matrices.shape != (count, dimension, dimension):
        raise ValueError(
            f"need one {dimension} x {dimension} matrix per center, got {tuple(matrices.shape)}"
        )
    if not torch.allclose(matrices, matrices.mT) or torch.linalg.eigvalsh(matrices).min() <= 0:
        raise ValueError("every A_k must be symmetric positive definite")
    return matrices


def quadratic_pareto_point(
    centers: torch.Tensor, matrices: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """The minimizer of sum_k w_k f_k: (sum w_k A_k)^-1 sum w_k A_k c_k, Pareto-stationary."""
    centers = torch.as_tensor(centers, dtype=DTYPE)
    matrices = torch.as_tensor(matrices, dtype=DTYPE)
    weights = torch.as_tensor(weights, dtype=DTYPE)
    combined = torch.einsum("...k,kij->...ij", weights, matrices)
    target = torch.einsum("...k,kij,kj->...i", weights, matrices, centers)
    return torch.linalg.solve(combined, target)


def _sampled_pareto_set(centers: torch.Tensor, matrices: torch.Tensor) -> torch.Tensor:
    return quadratic_pareto_point(centers, matrices, _simplex_grid(len(centers)))


def _simplex_grid(count: int, points: int = 2000) -> torch.Tensor:
    """About ``points`` simplex weights on a regular grid, vertices included."""
    divisions = max(2, round(points ** (1 / max(count - 1, 1))))
    heads = [
        head
        for head in itertools.product(range(divisions + 1), repeat=count - 1)
        if sum(head) <= divisions
    ]
    grid = torch.tensor([(*head, divisions - sum(head)) for head in heads], dtype=DTYPE)
    return grid / divisions


def _distance_to_hull(x: torch.Tensor, centers: torch.Tensor) -> float:
    """Distance from x to the convex hull of the centers: the min-norm point of {c_k - x}."""
    offsets = centers - x.detach().to(DTYPE)
    solution = solve_simplex_qp((offsets @ offsets.T).numpy())
    return max(solution.objective, 0.0) ** 0.5


def pareto_stationarity(jacobian: torch.Tensor) -> float:
    """Norm of the min-norm point of the gradients' convex hull, over the largest gradient norm.

    Zero at Pareto-stationary points (no direction decreases every objective), up to a
    round-off floor near 1e-8 (the square root of float64 precision); scale-free, so one
    tolerance serves every problem. All-zero gradients give 0.
    """
    gram = gram_matrix(jacobian.detach())
    largest = float(torch.diagonal(gram).max())
    if largest <= 0:
        return 0.0
    solution = solve_simplex_qp(gram.numpy())
    return (max(solution.objective, 0.0) / largest) ** 0.5


def is_pareto_stationary(jacobian: torch.Tensor, tolerance: float = 1e-6) -> bool:
    """Whether the gradients' convex hull (nearly) contains the origin."""
    return pareto_stationarity(jacobian) <= tolerance


@dataclass
class Trajectory:
    """One harmonized optimization run: where it went, what it cost, how it conflicted.

    ``positions`` and ``losses`` have one row per step plus the start; ``weights`` and
    ``diagnostics`` one per step. ``harmonizer_seconds`` is the mean time of one
    harmonizer call, ``seconds_per_step`` this run's share of a whole step.
    """

    positions: torch.Tensor
    losses: torch.Tensor
    weights: torch.Tensor
    diagnostics: list[dict] = field(default_factory=list)
    seconds_per_step: float = math.nan
    harmonizer_seconds: float = math.nan

    @property
    def final_position(self) -> torch.Tensor:
        return self.positions[-1]

    def cos_min(self) -> torch.Tensor:
        """Per-step worst cosine between the applied direction and an objective's gradient."""
        return torch.tensor([record["cos_min"] for record in self.diagnostics], dtype=DTYPE)


def optimize(
    problem: ToyProblem,
    harmonizer: Harmonizer,
    start: Sequence[float],
    steps: int = 1000,
    lr: float = 1e-3,
    optimizer: str = "adam",
) -> Trajectory:
    """Run ``steps`` harmonized steps from ``start``: Jacobian -> harmonizer -> .grad -> step.

    ``optimizer`` is ``"adam"`` (as in the CAGrad / Nash-MTL toys) or ``"sgd"``.
    """
    return optimize_starts(problem, lambda: harmonizer, [start], steps, lr, optimizer)[0]


def optimize_starts(
    problem: ToyProblem,
    new_harmonizer: Callable[[], Harmonizer],
    starts: Sequence[Sequence[float]],
    steps: int = 1000,
    lr: float = 1e-3,
    optimizer: str = "adam",
) -> list[Trajectory]:
    """Independent runs from several starts, batched to share the Jacobian pass.

    Each start gets its own harmonizer from ``new_harmonizer()`` (some methods keep state).
    Adam and SGD act elementwise, so one optimizer over the stacked points takes exactly
    the steps that separate optimizers would.
    """
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if lr <= 0:
        raise ValueError(f"lr must be positive, got {lr}")
    if len(starts) == 0:
        raise ValueError(f"no starts given (the problem lists {len(problem.starts)})")
    points = torch.stack([_checked_start(problem, start) for start in starts])
    points.requires_grad_(True)
    stepper = _make_optimizer(optimizer, points, lr)
    runs = [_RunRecorder(new_harmonizer(), [point.clone()]) for point in points.detach()]
    begin = time.perf_counter()
    for _ in range(steps):
        values, jacobians = problem.jacobian(points)
        directions = [
            run.harmonize(value, jacobian)
            for run, value, jacobian in zip(runs, values, jacobians, strict=True)
        ]
        write_gradient([points], torch.stack(directions).reshape(-1))
        stepper.step()
        for run, point in zip(runs, points.detach(), strict=True):
            run.positions.append(point.clone())
    seconds = (time.perf_counter() - begin) / max(steps, 1) / len(starts)
    return [run.trajectory(problem, seconds) for run in runs]


@dataclass
class _RunRecorder:
    """What one start's run accumulates step by step."""

    harmonizer: Harmonizer
    positions: list[torch.Tensor]
    losses: list[torch.Tensor] = field(default_factory=list)
    weights: list[torch.Tensor] = field(default_factory=list)
    diagnostics: list[dict] = field(default_factory=list)
    harmonizer_seconds: float = 0.0

    def harmonize(self, losses: torch.Tensor, jacobian: torch.Tensor) -> torch.Tensor:
        begin = time.perf_counter()
        harmonization = self.harmonizer(jacobian)
        self.harmonizer_seconds += time.perf_counter() - begin
        self.losses.append(losses)
        self.weights.append(harmonization.weights)
        self.diagnostics.append(
            conflict_diagnostics(
                harmonization.weights,
                jacobian=jacobian,
                direction=harmonization.direction,
                dropped=harmonization.dropped,
                fallback=harmonization.fallback,
            )
        )
        return harmonization.direction

    def trajectory(self, problem: ToyProblem, seconds_per_step: float) -> Trajectory:
        steps = len(self.weights)
        final = problem.losses(self.positions[-1])
        return Trajectory(
            positions=torch.stack(self.positions),
            losses=torch.stack([*self.losses, final]),
            weights=(
                torch.stack(self.weights)
                if steps
                else torch.empty(0, problem.num_objectives, dtype=DTYPE)
            ),
            diagnostics=self.diagnostics,
            seconds_per_step=seconds_per_step if steps else math.nan,
            harmonizer_seconds=self.harmonizer_seconds / steps if steps else math.nan,
        )


def _checked_start(problem: ToyProblem, start: Sequence[float]) -> torch.Tensor:
    point = torch.as_tensor(start, dtype=DTYPE).detach().clone()
    if point.shape != (problem.dimension,):
        raise ValueError(
            f"{problem.name} has dimension {problem.dimension}, got a start of shape "
            f"{tuple(point.shape)}"
        )
    return point


def _make_optimizer(name: str, points: torch.Tensor, lr: float) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam([points], lr=lr)
    if name == "sgd":
        return torch.optim.SGD([points], lr=lr)
    raise ValueError(f"unknown optimizer {name!r}; use 'adam' or 'sgd'")
