"""Gram matrices of large float32 stacks come out symmetric PSD and accurate."""

from __future__ import annotations

import pytest
import torch
from tolerances import reduction_atol

from mogradient._gram import DEFAULT_BLOCK_COLUMNS, accumulate_gram, gram_matrix, make_psd


def _rank_deficient_stack(rows: int, rank: int, columns: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    mixing = torch.randn(rows, rank, generator=generator)
    basis = torch.randn(rank, columns, generator=generator)
    return mixing @ basis


def test_large_rank_deficient_stack_is_psd_where_float32_is_not() -> None:
    stack = _rank_deficient_stack(5, 2, 20_000_000)
    naive = (stack @ stack.T).double()
    naive = 0.5 * (naive + naive.T)
    assert torch.linalg.eigvalsh(naive).min() < 0, "construction no longer exposes the problem"
    gram = gram_matrix(stack)
    eigenvalues = torch.linalg.eigvalsh(gram)
    assert eigenvalues.min() >= -1e-13 * eigenvalues.max()
    torch.testing.assert_close(gram, gram.T, rtol=0, atol=0)
    torch.linalg.cholesky(gram + 1e-12 * gram.diagonal().max() * torch.eye(5, dtype=gram.dtype))


def test_chunked_gram_matches_float64_reference() -> None:
    stack = torch.randn(4, 10_001)
    reference = stack.double() @ stack.double().T
    upcast = gram_matrix(stack, block_columns=997, upcast=True)
    torch.testing.assert_close(upcast, reference, rtol=1e-12, atol=1e-9)
    # Float32 chunk products, float64 accumulation: float32-level error per entry.
    native = gram_matrix(stack, block_columns=997)
    assert ((native - reference).abs() / reference.diagonal().max()).max() < 1e-6
    assert native.dtype == torch.float64


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("blocks", [3, 13])
def test_blocks_threads_and_strided_rows_give_the_float64_gram(threads: int, blocks: int) -> None:
    """Row products (a small stack) or one bmm over the threads (13 blocks: over 2^20
    entries) and a leftover block, on rows that are views of a wider tensor."""
    generator = torch.Generator().manual_seed(threads * 100 + blocks)
    scales = 10.0 ** torch.empty(5, 1).uniform_(-3, 3, generator=generator)
    wide = torch.randn(5, blocks * DEFAULT_BLOCK_COLUMNS + 1001, generator=generator) * scales
    stack = wide[:, 3:-5]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gram = accumulate_gram(stack)
    finally:
        torch.set_num_threads(before)
    exact = stack.double() @ stack.double().T  # products of float32s are exact in float64
    # Each block is one float32 reduction of its columns; float64 adds the blocks.
    bound = reduction_atol(torch.float32, DEFAULT_BLOCK_COLUMNS, 1.0) * (
        stack.double().abs() @ stack.double().abs().T
    )
    assert torch.equal(gram, gram.T)
    assert ((gram - exact).abs() <= bound).all()


def test_make_psd_clips_only_negative_eigenvalues() -> None:
    indefinite = torch.tensor([[1.0, 2.0], [2.0, 1.0]], dtype=torch.float64)
    assert torch.linalg.eigvalsh(make_psd(indefinite)).min() >= -1e-15
    positive = torch.tensor([[2.0, 0.5], [0.5, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(make_psd(positive), positive)


def test_bad_shapes_are_named() -> None:
    with pytest.raises(ValueError, match="2-D gradient stack"):
        gram_matrix(torch.zeros(3))
