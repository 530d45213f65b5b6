"""Gram matrices of per-objective gradient stacks that are always symmetric PSD.

A float32 Gram of a large rank-deficient Jacobian computed in one matmul often has
slightly negative eigenvalues, which makes QP-based harmonizers fail. We cut the columns
into blocks, multiply all blocks in one batched matmul in the stack's own precision
(short float32 sums, one parallel region, cache-sized operands), add the block products
in float64, symmetrize, and clip the round-off sized negative eigenvalues. Measured on
2 CPU cores, a 5 x 2e7 float32 stack takes ~22 ms this way against ~90 ms for one
float32 ``J @ J.T``, with ~5x smaller error. The optimality gap of a QP solved on this
Gram is second order in its error; ``upcast=True`` multiplies in float64 as well.
"""

from __future__ import annotations

import torch

DEFAULT_BLOCK_COLUMNS = 1 << 14
# Columns converted at a time when upcasting or widening half types (bounds the memory).
_UPCAST_SPAN_BLOCKS = 64


def gram_matrix(
    jacobian: torch.Tensor, block_columns: int = DEFAULT_BLOCK_COLUMNS, upcast: bool = False
) -> torch.Tensor:
    """Return the K x K float64 Gram matrix ``J @ J.T`` of a K x D stack, symmetric PSD."""
    return make_psd(accumulate_gram(jacobian, block_columns, upcast))


def accumulate_gram(
    jacobian: torch.Tensor, block_columns: int = DEFAULT_BLOCK_COLUMNS, upcast: bool = False
) -> torch.Tensor:
    """``J @ J.T`` summed over column blocks in float64, symmetrized, not yet made PSD.

    Rows with NaN or Inf only spoil their own row and column, so callers can drop them
    first and make the rest PSD.
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
    gram = torch.zeros(
        jacobian.shape[0], jacobian.shape[0], dtype=torch.float64, device=jacobian.device
    )
    for start in range(0, dim, span):
        piece = jacobian[:, start : start + span]
        gram += _blocked_products(piece.to(compute_dtype) if convert else piece, block_columns)
    return 0.5 * (gram + gram.T)


def _compute_dtype(dtype: torch.dtype, upcast: bool) -> torch.dtype:
    """float64 when asked; float32 for half types (float16 block sums overflow at norm ~256)."""
    if upcast:
        return torch.float64
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return dtype


def _blocked_products(piece: torch.Tensor, block_columns: int) -> torch.Tensor:
    """Sum of ``B @ B.T`` over column blocks: one bmm for full blocks, one matmul for the rest."""
    num_objectives, width = piece.shape
    full = width // block_columns
    total = torch.zeros(num_objectives, num_objectives, dtype=torch.float64, device=piece.device)
    if full:
        blocks = piece[:, : full * block_columns].reshape(num_objectives, full, block_columns)
        blocks = blocks.transpose(0, 1)
        total += torch.bmm(blocks, blocks.transpose(1, 2)).sum(dim=0, dtype=torch.float64)
    if full * block_columns < width:
        rest = piece[:, full * block_columns :]
        total += (rest @ rest.T).to(torch.float64)
    return total


def make_psd(gram: torch.Tensor) -> torch.Tensor:
    """Symmetrize a Gram matrix and clip negative eigenvalues to zero (float64)."""
    gram = gram.to(torch.float64)
    gram = 0.5 * (gram + gram.T)
    if gram.numel() == 0 or not torch.isfinite(gram).all():
        return gram
    eigenvalues, eigenvectors = torch.linalg.eigh(gram)
    if eigenvalues.min() >= 0:
        return gram
    clipped = eigenvalues.clamp_min(0)
    psd = (eigenvectors * clipped) @ eigenvectors.T
    return 0.5 * (psd + psd.T)
