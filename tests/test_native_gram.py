"""The compiled float32 Gram kernel against float64 references, and its fallbacks."""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest
import torch
from tolerances import reduction_atol

from mogradient import native_gram
from mogradient.gram import accumulate_gram

# A chunk holds at most 24 KiB / 4 B = 6144 columns, so each of the 32 float32 lane sums
# adds at most 192 products; with the product and the lane merges, fewer than 200
# roundings separate an entry from its exact value.
ROUNDING_DEPTH = 200

needs_kernel = pytest.mark.skipif(
    native_gram._compiler() is None, reason="no C compiler on this machine"
)


def _stack(rows: int, columns: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    scales = 10.0 ** torch.empty(rows, 1).uniform_(-3, 3, generator=generator)
    return torch.randn(rows, columns, generator=generator) * scales


def _assert_exact(gram: torch.Tensor, stack: torch.Tensor) -> None:
    exact = stack.double() @ stack.double().T  # products of float32s are exact in float64
    magnitudes = stack.double().abs() @ stack.double().abs().T
    bound = reduction_atol(torch.float32, ROUNDING_DEPTH, 1.0) * magnitudes
    assert gram.dtype == torch.float64
    assert torch.equal(gram, gram.T)
    assert ((gram - exact).abs() <= bound).all(), ((gram - exact).abs() / magnitudes).max()


@needs_kernel
def test_a_machine_with_a_compiler_uses_the_kernel() -> None:
    assert native_gram.available()


@needs_kernel
@pytest.mark.parametrize(
    ("rows", "columns"),
    [(1, 1), (1, 37), (2, 31), (3, 32), (5, 1000), (17, 4099), (5, (1 << 20) // 5 + 7)],
)
def test_kernel_matches_the_float64_gram(rows: int, columns: int) -> None:
    stack = _stack(rows, columns, seed=rows * 1000 + columns)
    _assert_exact(native_gram.float32_gram(stack), stack)


@needs_kernel
def test_rows_may_be_strided_views_of_a_wider_tensor() -> None:
    wide = _stack(4, 3001, seed=1)
    view = wide[:, 3:2903]
    assert view.stride(0) != view.shape[1]
    _assert_exact(native_gram.float32_gram(view), view)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_thread_count_gives_an_exact_gram(threads: int) -> None:
    stack = _stack(5, 400_003, seed=threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gram = native_gram.float32_gram(stack)
    finally:
        torch.set_num_threads(before)
    _assert_exact(gram, stack)


@needs_kernel
def test_a_nan_entry_spoils_only_its_row_and_column() -> None:
    stack = _stack(3, 1000, seed=2)
    stack[1, 17] = float("nan")
    gram = native_gram.float32_gram(stack)
    assert torch.isnan(gram[1]).all() and torch.isnan(gram[:, 1]).all()
    assert torch.isfinite(gram[[0, 2]][:, [0, 2]]).all()


def test_stacks_it_cannot_read_are_left_to_torch() -> None:
    stack = _stack(3, 100, seed=3)
    assert native_gram.float32_gram(stack.double()) is None
    assert native_gram.float32_gram(stack.T.contiguous().T) is None  # columns not contiguous
    assert native_gram.float32_gram(stack[:, :0]) is None
    with_grad = stack.clone().requires_grad_()
    assert native_gram.float32_gram(with_grad) is None
    with torch.no_grad():
        assert native_gram.float32_gram(with_grad) is not None or not native_gram.available()


def test_switched_off_the_gram_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOGRADIENT_NATIVE", "0")
    native_gram._library.cache_clear()
    try:
        stack = _stack(5, 70_001, seed=4)
        assert not native_gram.available()
        assert native_gram.float32_gram(stack) is None
        _assert_exact(accumulate_gram(stack), stack)
    finally:
        monkeypatch.undo()
        native_gram._library.cache_clear()


@needs_kernel
def test_the_build_is_cached_per_machine(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("MOGRADIENT_CACHE_DIR", str(tmp_path))
    native_gram._library.cache_clear()
    try:
        assert native_gram.available()
        (built,) = (tmp_path / "mogradient").glob("gram_kernel_*.so")
        stamp = built.stat().st_mtime_ns
        native_gram._library.cache_clear()
        assert native_gram.available()
        assert built.stat().st_mtime_ns == stamp
    finally:
        monkeypatch.undo()
        native_gram._library.cache_clear()


def _gram_in_child(queue: multiprocessing.Queue) -> None:
    torch.set_num_threads(1)  # what torch's DataLoader does in its workers
    stack = torch.from_numpy(np.ones((5, 1 << 18), dtype=np.float32))
    queue.put(float(native_gram.float32_gram(stack)[0, 0]))


@needs_kernel
def test_a_forked_single_threaded_child_can_use_the_kernel() -> None:
    """GNU OpenMP cannot run a parallel team in a child forked after the parent ran one (the
    kernel shares this with torch's own ops); a child set to one thread, as DataLoader
    workers are, must still compute."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        native_gram.float32_gram(_stack(5, 1 << 18, seed=6))
        context = multiprocessing.get_context("fork")
        queue = context.Queue()
        child = context.Process(target=_gram_in_child, args=(queue,))
        child.start()
        child.join(timeout=60)
        assert child.exitcode == 0, "the forked child hung or failed"
        assert queue.get(timeout=5) == 1 << 18
    finally:
        torch.set_num_threads(before)
