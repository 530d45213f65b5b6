"""Many dual-cone projections on one matrix, solved together: x_j = argmin ||A (t_j + x)||
over x >= 0, for every row t_j of a target matrix.

UPGrad solves K of these NNLS problems (one per gradient, `mogradient._qp_cone`)
on the same factor A (A^T A = the cosines). One at a time, Lawson & Hanson's method
costs K problems x ~K/2 pivots x one SVD each: 5-10 s at K = 128 and minutes at 256.
Here all problems run Kim & Park's block principal pivoting (SIAM J. Sci. Comput. 2011)
at once: a pass exchanges every index whose sign condition fails, so a few passes reach
the optimal passive sets, and a pass is one batched Cholesky of the passive Gram blocks.
A few accelerated projected-gradient steps (one K x K x K product each) guess the passive
sets first, which saves the widest passes.

The passes take signs on C + ridge I, positive definite even when gradients are exactly
dependent (duplicated samples). The last passive blocks' answers are then refined on C
itself (iterated Tikhonov with the same Cholesky factors: each step keeps only
ridge / (ridge + sigma^2) of the error along a singular value sigma) with residuals taken
in A's coordinates, and each problem is certified by its KKT residual, measured as the
sequential solver measures it. Problems that do not certify, or whose weights cancel, are
left to the exact sequential solver. Pivoting certifies nearly every problem on
well-conditioned Grams, duplicated gradients and per-sample Grams of a trained MLP
(smallest kept cosine eigenvalue ~1e-4 of the largest); on ill-conditioned ones (~1e-7)
and on stacks of much lower rank than K, full exchanges cycle and most problems fall
back (figures: benchmarks/results/upgrad_scaling.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

_EPS = float(torch.finfo(torch.float64).eps)
# Signs within this many units of round-off of the sizes involved count as zero.
_SIGN_TOLERANCE = 64 * _EPS
# Positive-definite shift of the unit-diagonal Gram while pivoting: refining then
# recovers every direction with sigma^2 above ~1e-6, the sequential solver the rest.
_RIDGE = 1e-10
_REFINE_STEPS = 3
_WARM_STEPS = 40
# Below this many gradients a pass costs less than the warm start: start from x = 0
# (passive = the gradients that conflict with the target).
_WARM_FROM = 32
# Passes without fewer infeasible indices after which a problem is left to the sequential
# solver (where Kim & Park switch to single exchanges: hundreds of passes when cycling).
_STALLED_PASSES = 3
# A cap on passes; the stall rule ended every cycling run measured well before it.
_MAX_PASSES = 16
# Certified answers have a KKT residual at most this (~9e-13), the level the sequential
# solver reaches (1e-16..4e-13 on the benchmark's Grams).
_ACCEPT_RESIDUAL = 2.0**12 * _EPS
# Weights beyond this multiple of the target cancel: the sequential solver chooses.
_CANCELLATION_LIMIT = 1e3


@dataclass(frozen=True)
class BatchedProjections:
    """Multipliers x (m x K), KKT residuals (m) and which problems are certified (m)."""

    multipliers: torch.Tensor
    residuals: torch.Tensor
    certified: torch.Tensor


def project_all(factor: torch.Tensor, targets: torch.Tensor) -> BatchedProjections:
    """x_j = argmin ||A (t_j + x)|| over x >= 0 for each row t_j of ``targets`` (m x K).

    ``factor`` is A (r x K, float64); A (t_j + x_j) is the projection of A t_j onto the
    cone {y : A^T y >= 0}. Uncertified rows hold whatever the passes reached.
    """
    gram = factor.T @ factor
    linear = targets @ gram
    multipliers = torch.zeros_like(targets)
    passive = _warm_start(gram, linear) if len(gram) >= _WARM_FROM else linear < 0
    for rows, solved, cholesky, order in _pivoted(gram, linear, passive, targets):
        multipliers[rows] = _refined(factor, targets[rows], solved, cholesky, order)
    residuals = _residuals(factor, targets, multipliers)
    bounded = (targets + multipliers).abs().amax(dim=1)
    certified = torch.isfinite(residuals) & (residuals <= _ACCEPT_RESIDUAL)
    certified &= bounded <= _CANCELLATION_LIMIT * targets.abs().amax(dim=1)
    return BatchedProjections(multipliers, residuals, certified)


def _warm_start(gram: torch.Tensor, linear: torch.Tensor) -> torch.Tensor:
    """Passive sets guessed by accelerated projected gradient (FISTA) from x = 0."""
    lipschitz = float(torch.linalg.eigvalsh(gram)[-1])
    current = torch.zeros_like(linear)
    point, momentum = current, 1.0
    for _ in range(_WARM_STEPS):
        following = (point - (point @ gram + linear) / lipschitz).clamp_min(0.0)
        next_momentum = 0.5 * (1.0 + (1.0 + 4.0 * momentum**2) ** 0.5)
        point = following + ((momentum - 1.0) / next_momentum) * (following - current)
        current, momentum = following, next_momentum
    return current > 0


def _pivoted(
    gram: torch.Tensor, linear: torch.Tensor, passive: torch.Tensor, targets: torch.Tensor
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Block principal pivoting on C + ridge I; yields (rows, x, Cholesky factors, orders)
    for the problems whose sign conditions hold, pass by pass. Problems that stop
    progressing are dropped (left to the sequential solver)."""
    problems, count = linear.shape
    extended = torch.zeros(count + 1, count + 1, dtype=gram.dtype)
    extended[:count, :count] = gram
    extended[count, count] = 1.0  # the padding index: orthonormal to every gradient
    best = torch.full((problems,), count + 1)
    stalled = torch.zeros(problems, dtype=torch.int64)
    rows = torch.arange(problems)
    scales = targets.abs().sum(dim=1, keepdim=True)
    for _ in range(_MAX_PASSES):
        if len(rows) == 0:
            return
        solved, cholesky, order = _passive_solve(extended, linear[rows], passive[rows])
        duals = solved @ gram + linear[rows]
        noise = _SIGN_TOLERANCE * (scales[rows] + solved.abs().sum(dim=1, keepdim=True))
        infeasible = torch.where(passive[rows], solved, duals) < -noise
        counts = infeasible.sum(dim=1)
        done = counts == 0
        yield rows[done], solved[done], cholesky[done], order[done]
        progress = counts < best[rows]
        best[rows] = torch.minimum(counts, best[rows])
        stalled[rows] = torch.where(progress, 0, stalled[rows] + 1)
        passive[rows] ^= infeasible
        rows = rows[~done & (stalled[rows] < _STALLED_PASSES)]


def _passive_solve(
    extended: torch.Tensor, linear: torch.Tensor, passive: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x_P = -(C_PP + ridge I)^-1 q_P and x = 0 elsewhere, for every row, with the
    Cholesky factors of the blocks and their index orders (padded with index K)."""
    problems, count = linear.shape
    sizes = passive.sum(dim=1)
    width = max(int(sizes.max()), 1) if problems else 1
    order = torch.argsort((~passive).to(torch.int8), dim=1, stable=True)[:, :width]
    order = torch.where(torch.arange(width)[None, :] < sizes[:, None], order, count)
    blocks = extended[order[:, :, None], order[:, None, :]]
    blocks.diagonal(dim1=1, dim2=2).add_(_RIDGE)
    cholesky, _ = torch.linalg.cholesky_ex(blocks)
    solution = _cholesky_solve(cholesky, -_gathered(linear, order))
    return _scattered(solution, order, count), cholesky, order


def _refined(
    factor: torch.Tensor,
    targets: torch.Tensor,
    multipliers: torch.Tensor,
    cholesky: torch.Tensor,
    order: torch.Tensor,
) -> torch.Tensor:
    """Iterated Tikhonov on each passive block, residuals in A's coordinates; x >= 0."""
    for _ in range(_REFINE_STEPS):
        duals = ((targets + multipliers) @ factor.T) @ factor
        step = _cholesky_solve(cholesky, -_gathered(duals, order))
        multipliers = multipliers + _scattered(step, order, targets.shape[1])
    return multipliers.clamp_min(0.0)


def _gathered(values: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Entries of each row of ``values`` (m x K) at ``order``; the padding index K gives 0."""
    padded = torch.cat([values, values.new_zeros(len(values), 1)], dim=1)
    return padded.gather(1, order)


def _scattered(values: torch.Tensor, order: torch.Tensor, count: int) -> torch.Tensor:
    """Rows of length ``count`` holding ``values`` at ``order`` (padding dropped), else 0."""
    result = values.new_zeros(len(values), count + 1)
    result.scatter_(1, order, values)
    return result[:, :count]


def _cholesky_solve(cholesky: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """(L L^T)^-1 b for a batch of lower factors L and vectors b (two triangular solves)."""
    half = torch.linalg.solve_triangular(cholesky, right[:, :, None], upper=False)
    return torch.linalg.solve_triangular(cholesky.mT, half, upper=True)[:, :, 0]


def _residuals(
    factor: torch.Tensor, targets: torch.Tensor, multipliers: torch.Tensor
) -> torch.Tensor:
    """KKT residual of every projection y = A (t + x): the largest of the conflict
    cosine -a_k.y / (||a_k|| ||A t||) and the complementarity |x_k a_k.y| / (||A t|| M),
    M = ||A t|| + sum_k x_k ||a_k|| (see `mogradient._qp_cone._projection_residual`)."""
    sizes = torch.linalg.vector_norm(targets @ factor.T, dim=1)
    inner = ((targets + multipliers) @ factor.T) @ factor
    column_norms = torch.linalg.vector_norm(factor, dim=0)
    tiny = torch.finfo(torch.float64).tiny
    conflict = (-inner / column_norms.clamp_min(tiny)).amax(dim=1) / sizes
    magnitude = sizes + multipliers @ column_norms
    complementarity = (multipliers * inner).abs().amax(dim=1) / (sizes * magnitude)
    return torch.maximum(conflict, complementarity).clamp_min(0.0)
