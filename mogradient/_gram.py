"""Gram matrices of per-objective gradient stacks that are always symmetric PSD.

A float32 Gram of a large rank-deficient Jacobian computed in one matmul often has
slightly negative eigenvalues, which makes QP-based harmonizers fail. We multiply
cache-sized column blocks in one batched matmul in the stack's own precision, add the
block products in float64, symmetrize, and clip the round-off sized negative
eigenvalues: faster than one ``J @ J.T`` of a long stack, and far more accurate (times
and errors in benchmarks/results/mgda_exactness.md and native_gram.md). The optimality
gap of a QP solved on this Gram is second order in its error; ``upcast=True``
multiplies in float64 as well.

Gradient norms may differ by many orders of magnitude. Three things keep small gradients
exact: rows whose squared norm over- or underflows the multiplication dtype are scaled
by powers of two (exact) and the Gram recomputed, with each row's power kept beside it
(`scaled_gram`), since squared norms can leave even float64's range; methods read
the Gram as cosines and norms ([`CosineGram`][mogradient.harmonizers.CosineGram]); and the PSD
repair runs on the unit-diagonal (cosine) matrix, where an eigen-decomposition's round-off is
relative to each row's own norm instead of the largest one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

DEFAULT_BLOCK_COLUMNS = 1 << 14
_FLOAT64_EPS = float(np.finfo(np.float64).eps)
# Columns converted at a time when upcasting or widening half types (bounds the memory).
_UPCAST_SPAN_BLOCKS = 64
# CPU stack entries from which the blocks' products run in one bmm over torch's threads.
_PARALLEL_ENTRIES = 1 << 20


def gram_matrix(
    jacobian: torch.Tensor, block_columns: int = DEFAULT_BLOCK_COLUMNS, upcast: bool = False
) -> torch.Tensor:
    """Return the K x K float64 Gram matrix ``J @ J.T`` of a K x D stack, symmetric PSD.

    Entries beyond float64's range (rows below ~1e-154 or above ~1e154) are rounded to
    zero, a subnormal or Inf; `scaled_gram` keeps them.
    """
    scaled, exponents = scaled_gram(jacobian, block_columns, upcast)
    return unscaled(make_psd(scaled), exponents)


def accumulate_gram(
    jacobian: torch.Tensor, block_columns: int = DEFAULT_BLOCK_COLUMNS, upcast: bool = False
) -> torch.Tensor:
    """``J @ J.T`` summed over column blocks in float64, symmetrized, not yet made PSD.

    Rows with NaN or Inf only spoil their own row and column, so callers can drop them
    first and make the rest PSD.
    """
    return unscaled(*scaled_gram(jacobian, block_columns, upcast))


def scaled_gram(
    jacobian: torch.Tensor, block_columns: int = DEFAULT_BLOCK_COLUMNS, upcast: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``J @ J.T`` as (S, e) with J J^T = diag(2^e) S diag(2^e): float64 S, integer e.

    Why: a row's squared norm leaves float64's range where its norm does not (a float64
    row at 1e-160 squares to 1e-320), so rows that over- or underflow are scaled by
    powers of two, exactly, and each power is kept instead of being multiplied back in.
    e is zero for rows that need no scaling, and for zero or non-finite rows.
    """
    if jacobian.ndim != 2:
        raise ValueError(
            f"expected a 2-D gradient stack of shape (K objectives, D parameters), "
            f"got shape {tuple(jacobian.shape)}"
        )
    if block_columns <= 0:
        raise ValueError(f"block_columns must be positive, got {block_columns}")
    dim = jacobian.shape[1]
    compute_dtype = _compute_dtype(jacobian.dtype, upcast)
    convert = compute_dtype != jacobian.dtype
    span = block_columns * _UPCAST_SPAN_BLOCKS if convert else max(dim, 1)
    gram = _summed_products(jacobian, compute_dtype, block_columns, span, None)
    exponents = torch.zeros(jacobian.shape[0], dtype=torch.int64)
    suspect = _out_of_range(torch.diagonal(gram), compute_dtype, dim)
    if suspect.any() and _rescalable(jacobian[suspect.to(jacobian.device)]).any():
        exponents = _row_exponents(jacobian)
        gram = _summed_products(jacobian, compute_dtype, block_columns, span, exponents)
    return 0.5 * (gram + gram.T), exponents


def unscaled(scaled: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """diag(2^e) S diag(2^e) in float64: exact, except where it leaves float64's range
    (rounded to a subnormal, zero or Inf). One power per entry, so nothing overflows on
    the way to a representable result."""
    powers = exponents.cpu().numpy()
    with np.errstate(over="ignore", under="ignore"):
        values = np.ldexp(scaled.cpu().numpy(), powers[:, None] + powers[None, :])
    return torch.from_numpy(values).to(scaled.device)


def _summed_products(
    jacobian: torch.Tensor,
    compute_dtype: torch.dtype,
    block_columns: int,
    span: int,
    row_exponents: torch.Tensor | None,
) -> torch.Tensor:
    """Float64 sum of blocked products over column spans, rows optionally scaled by 2^-e."""
    size = jacobian.shape[0]
    gram = torch.zeros(size, size, dtype=torch.float64, device=jacobian.device)
    if row_exponents is not None:
        span = min(span, block_columns * _UPCAST_SPAN_BLOCKS)
        factors = _half_step_factors(row_exponents, compute_dtype, jacobian.device)
    for start in range(0, jacobian.shape[1], span):
        piece = jacobian[:, start : start + span].to(compute_dtype)
        if row_exponents is not None:
            piece = piece * factors[0] * factors[1]
        gram += _blocked_products(piece, block_columns)
    return gram


def _half_step_factors(
    exponents: torch.Tensor, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two columns of powers of two whose product is 2^-e, each representable in ``dtype``.

    Why two: a subnormal float32 row (1e-40) needs 2^132, beyond float32's range, while
    each half (2^66) is not; multiplying by either is exact.
    """
    first = exponents // 2
    ones = torch.ones(len(exponents), dtype=torch.float64)
    return tuple(
        torch.ldexp(ones, -part).to(dtype=dtype, device=device)[:, None]
        for part in (first, exponents - first)
    )


def _out_of_range(squared_norms: torch.Tensor, dtype: torch.dtype, dim: int) -> torch.Tensor:
    """Rows whose products in ``dtype`` may have over- or underflowed.

    A product below ``tiny`` loses bits; summed over D entries that costs at most
    ``D * tiny``, negligible (below ``eps``) relative to a squared norm above
    ``D * tiny / eps``. A finite squared norm means no block product overflowed.
    Exactly zero rows are flagged too: they may be underflowed non-zero ones.
    """
    info = torch.finfo(dtype)
    smallest = dim * info.tiny / info.eps
    return ~torch.isfinite(squared_norms) | (squared_norms < smallest)


def _largest_entries(rows: torch.Tensor) -> torch.Tensor:
    """max_j |row_j| per row in float64 (NaN or Inf for rows holding them)."""
    return torch.linalg.vector_norm(rows, ord=float("inf"), dim=1).to(torch.float64)


def _rescalable(rows: torch.Tensor) -> torch.Tensor:
    """Rows that are finite and not exactly zero: rescaling recovers their products."""
    largest = _largest_entries(rows)
    return torch.isfinite(largest) & (largest > 0)


def _row_exponents(jacobian: torch.Tensor) -> torch.Tensor:
    """Per-row e with max|row| * 2^-e in [0.5, 1): the exponent of an exact rescaling.

    Rows that are zero or hold NaN/Inf get 0 (they stay zero or non-finite).
    """
    largest = _largest_entries(jacobian).cpu()
    usable = torch.isfinite(largest) & (largest > 0)
    _, exponents = torch.frexp(torch.where(usable, largest, torch.ones_like(largest)))
    return torch.where(usable, exponents.to(torch.int64), 0)


def _compute_dtype(dtype: torch.dtype, upcast: bool) -> torch.dtype:
    """float64 when asked; float32 for half types (float16 block sums overflow at norm ~256)."""
    if upcast:
        return torch.float64
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return dtype


def _blocked_products(piece: torch.Tensor, block_columns: int) -> torch.Tensor:
    """Sum of ``B @ B.T`` over column blocks: one bmm over full blocks, row products for the rest.

    The bmm spreads its blocks over torch's threads (the BLAS inside each runs on one).
    On a machine shared with other jobs any parallel region (the bmm's, or MKL's inside a
    lone small matmul) waits for a descheduled thread, many times the product's own time
    on a small stack (benchmarks/results/native_gram.md): leftover columns and CPU stacks
    below ``_PARALLEL_ENTRIES`` go through single-threaded matrix-vector products instead.
    """
    num_objectives, width = piece.shape
    batched = piece.device.type != "cpu" or piece.numel() >= _PARALLEL_ENTRIES
    full = width // block_columns if batched and width >= 2 * block_columns else 0
    total = torch.zeros(num_objectives, num_objectives, dtype=torch.float64, device=piece.device)
    if full:
        blocks = piece[:, : full * block_columns].reshape(num_objectives, full, block_columns)
        blocks = blocks.transpose(0, 1)
        total += torch.bmm(blocks, blocks.transpose(1, 2)).sum(dim=0, dtype=torch.float64)
    for start in range(full * block_columns, width, block_columns):
        total += _row_products(piece[:, start : start + block_columns])
    return total


def _row_products(block: torch.Tensor) -> torch.Tensor:
    """``block @ block.T`` in float64, one matrix-vector product per row on CPU."""
    if block.device.type != "cpu":
        return (block @ block.T).to(torch.float64)
    return torch.stack([torch.mv(block, row) for row in block], dim=1).to(torch.float64)


def make_psd(gram: torch.Tensor) -> torch.Tensor:
    """Symmetrize a Gram matrix and clip negative eigenvalues to zero (float64).

    The repair runs on the cosine matrix D^-1 G D^-1 (D = diag(||g_k||)) and is scaled
    back, so it is exact in each row's own units whatever the spread of the norms.
    """
    gram = gram.to(torch.float64)
    gram = 0.5 * (gram + gram.T)
    if gram.numel() == 0 or not torch.isfinite(gram).all():
        return gram
    norms = torch.sqrt(torch.diagonal(gram).clamp_min(0))
    inverse = torch.where(norms > 0, 1.0 / norms, torch.zeros_like(norms))
    repaired = _clipped(gram * torch.outer(inverse, inverse))
    if repaired is None:
        return gram
    return repaired * torch.outer(norms, norms)


def _clipped(cosines: torch.Tensor) -> torch.Tensor | None:
    """The symmetric matrix with the negative eigenvalues of ``cosines`` set to zero,
    or None when there are none."""
    eigenvalues, eigenvectors = torch.linalg.eigh(cosines)
    if eigenvalues.min() >= 0:
        return None
    repaired = (eigenvectors * eigenvalues.clamp_min(0)) @ eigenvectors.T
    return 0.5 * (repaired + repaired.T)


@dataclass(frozen=True)
class CosineGram:
    """The Gram of K non-zero finite gradients as G = 4^exponent diag(n) C diag(n).

    Why: G holds squared norms, which leave float64's range where the norms do not (a
    float64 gradient at 1e-160, alone or beside one at 1), so the harmonizers read the
    cosines C (symmetric PSD, unit diagonal, round-off negative eigenvalues clipped) and
    the norms n (the largest in [0.5, 1); ||g_k|| = n_k 2^exponent) and work in each
    gradient's own units.

    Precision, as machine epsilons: ``eps`` that of the gradients (their dtype's, and the
    dtype a direction is formed in; float32's at best for a Gram passed in,
    `gram_eps`), ``cosine_eps`` that of the cosines (the dtype the Gram was summed
    in: float32 for a half-precision stack, whose products are exact there). Why: every
    decision that zero is in the hull, or that gradients are dependent, must be taken at
    the input's precision. Two float32 gradients 1e-8 from exact opposition are opposed
    within it, and weights that cancel beyond 1/eps give a direction of round-off.
    """

    cosines: torch.Tensor
    norms: torch.Tensor
    exponent: int
    eps: float = _FLOAT64_EPS
    cosine_eps: float = _FLOAT64_EPS

    @classmethod
    def from_scaled(
        cls,
        scaled: torch.Tensor,
        exponents: torch.Tensor,
        eps: float = _FLOAT64_EPS,
        cosine_eps: float = _FLOAT64_EPS,
    ) -> CosineGram:
        """From S and e of `scaled_gram` (G = diag(2^e) S diag(2^e)), with the
        precisions of the gradients and of S; S's diagonal must be positive and finite."""
        scaled = scaled.to(torch.float64).cpu()
        sizes = torch.sqrt(torch.diagonal(scaled))
        cosines = scaled / torch.outer(sizes, sizes)
        cosines = 0.5 * (cosines + cosines.T)
        repaired = _clipped(cosines)
        if repaired is not None:
            diagonal = torch.sqrt(torch.diagonal(repaired))
            cosines = repaired / torch.outer(diagonal, diagonal)
        cosines.fill_diagonal_(1.0)
        mantissas, powers = torch.frexp(sizes)
        powers = powers.to(torch.int64) + exponents.cpu()
        top = int(powers.max())
        norms = np.ldexp(mantissas.numpy(), (powers - top).numpy())
        return cls(cosines, torch.from_numpy(norms), top, eps, cosine_eps)

    def __len__(self) -> int:
        return len(self.norms)

    def matrix(self) -> torch.Tensor:
        """diag(n) C diag(n): G / 4^exponent, whose largest diagonal entry is in [0.25, 1).

        Entries of gradients below ~1e-154 of the largest underflow: methods that must
        resolve those read ``cosines`` and ``norms``.
        """
        return self.cosines * torch.outer(self.norms, self.norms)

    def subset(self, indices: torch.Tensor) -> CosineGram:
        """The Gram of the gradients at ``indices`` (same exponent)."""
        return CosineGram(
            self.cosines[indices][:, indices],
            self.norms[indices],
            self.exponent,
            self.eps,
            self.cosine_eps,
        )


def gram_tolerance(dtype: torch.dtype) -> float:
    """Largest error in a cosine G_ij / sqrt(G_ii G_jj) that round-off in ``dtype`` explains.

    A D-term dot product is off by up to D u ||g_i|| ||g_j|| in any summation order
    (Higham 2002, eq. 3.4); BLAS's blocked sums stay far below that (torch's float32
    J @ J.T of 1e7-long Gaussian rows: 2e-3). We allow 2^16 eps: 7.8e-3 for float32,
    against the O(1) defects of a matrix that is not a Gram. Float32 is the floor: a
    float64 Gram is often summed from float32 products (gradients trained in float32,
    ``RowGradients.gram``), so its dtype does not promise more.
    """
    return 2.0**16 * torch.finfo(_precision(dtype)).eps


def summed_eps(dtype: torch.dtype) -> float:
    """Machine epsilon of the dtype `scaled_gram` sums a ``dtype`` stack's Gram in."""
    return torch.finfo(_compute_dtype(dtype, upcast=False)).eps


def gram_eps(gram: torch.Tensor | np.ndarray) -> float:
    """Machine epsilon of the precision a Gram passed in carries: its dtype's, float32's at
    best (see `gram_tolerance`)."""
    dtype = torch.as_tensor(gram).dtype
    return torch.finfo(_precision(dtype if dtype.is_floating_point else torch.float64)).eps


def validated_gram(gram: torch.Tensor | np.ndarray) -> torch.Tensor:
    """A Gram matrix passed in by a caller, checked, as a symmetric float64 CPU tensor.

    Why one check for every consumer: a matrix that is not a Gram makes each method fail
    its own way, or silently. Objectives whose squared norm is NaN or Inf are left for
    the caller to drop (their row and column may hold anything). Among the others every
    entry must be finite, squared norms non-negative, cosines at most 1 + tolerance and
    symmetric to `gram_tolerance`, and the cosine matrix PSD to (K - 1) times it
    (a bound on the spectral norm of entrywise errors). A zero squared norm may be an
    underflowed one: its products are bounded with the dtype's smallest normal instead.
    Raises ValueError naming the entry and the fix.
    """
    tensor = torch.as_tensor(gram).detach()
    if tensor.ndim != 2 or tensor.shape[0] != tensor.shape[1] or tensor.shape[0] == 0:
        _invalid(f"it must be square and non-empty, got shape {tuple(tensor.shape)}")
    dtype = tensor.dtype if tensor.is_floating_point() else torch.float64
    values = tensor.to(torch.float64).cpu()
    indices = torch.nonzero(torch.isfinite(torch.diagonal(values))).flatten()
    names = [int(index) for index in indices]
    problem = _non_finite(values[indices][:, indices], names) or _not_psd(
        values[indices][:, indices], names, dtype
    )
    if problem is not None:
        _invalid(problem)
    return 0.5 * (values + values.T)


def _precision(dtype: torch.dtype) -> torch.dtype:
    """The dtype whose round-off a Gram of ``dtype`` may carry: float32 at best."""
    finer = torch.finfo(dtype).eps < torch.finfo(torch.float32).eps
    return torch.float32 if finer else dtype


def _non_finite(gram: torch.Tensor, names: list[int]) -> str | None:
    """A NaN/Inf entry or a negative squared norm among objectives with finite squared norms."""
    bad = torch.nonzero(~torch.isfinite(gram))
    if len(bad):
        i, j = bad[0].tolist()
        return (
            f"G[{names[i]}, {names[j]}] is {gram[i, j].item()} (NaN or Inf) although "
            f"objectives {names[i]} and {names[j]} have finite squared norms"
        )
    negative = torch.nonzero(torch.diagonal(gram) < 0).flatten()
    if len(negative):
        k = int(negative[0])
        return f"squared norm G[{names[k]}, {names[k]}] = {gram[k, k].item():.6g} is negative"
    return None


def _not_psd(gram: torch.Tensor, names: list[int], dtype: torch.dtype) -> str | None:
    """An asymmetric pair, a cosine beyond 1, or a negative eigenvalue beyond round-off."""
    tolerance = gram_tolerance(dtype)
    diagonal = torch.diagonal(gram)
    floor = torch.finfo(_precision(dtype)).tiny
    norms = torch.sqrt(torch.where(diagonal > 0, diagonal, floor))
    cosines = gram / torch.outer(norms, norms)
    i, j = divmod(int((cosines - cosines.T).abs().argmax()), len(gram))
    if abs(cosines[i, j] - cosines[j, i]) > tolerance:
        return (
            f"it is not symmetric: G[{names[i]}, {names[j]}] = {gram[i, j].item():.6g} and "
            f"G[{names[j]}, {names[i]}] = {gram[j, i].item():.6g} differ by "
            f"{abs(cosines[i, j] - cosines[j, i]).item():.2g} of sqrt(G_ii G_jj), beyond "
            f"round-off ({tolerance:.1e})"
        )
    i, j = divmod(int(cosines.abs().argmax()), len(gram))
    if abs(cosines[i, j]) > 1 + tolerance:
        bound = torch.sqrt(diagonal[i] * diagonal[j]).item()
        return (
            f"|G[{names[i]}, {names[j]}]| = {abs(gram[i, j].item()):.6g} exceeds "
            f"sqrt(G[{names[i]}, {names[i]}] G[{names[j]}, {names[j]}]) = {bound:.6g} "
            "(Cauchy-Schwarz), beyond round-off"
        )
    positive = diagonal > 0
    if int(positive.sum()) < 2:
        return None
    unit = cosines[positive][:, positive]
    smallest = float(torch.linalg.eigvalsh(0.5 * (unit + unit.T))[0])
    bound = (len(unit) - 1) * tolerance
    if smallest < -bound:
        return (
            f"it is not positive semidefinite: its cosine matrix G_ij / sqrt(G_ii G_jj) has "
            f"eigenvalue {smallest:.3g}, beyond round-off (-{bound:.1e})"
        )
    return None


def _invalid(problem: str) -> None:
    raise ValueError(
        f"invalid Gram matrix: {problem}. A Gram matrix is J @ J.T for the K x D stack J of "
        "per-objective gradients: symmetric positive semidefinite, and finite wherever both "
        "squared norms are. Pass the stack itself, or compute the Gram with "
        "mogradient.qp.gram_matrix(J)."
    )
