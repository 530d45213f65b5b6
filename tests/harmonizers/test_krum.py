"""Krum against brute force and TorchJD."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mogradient.harmonizers import (
    Krum,
)

from .stacks import STRESS, STRESS_IDS, U32, parity_stacks, random_stack, relative

aggregation = pytest.importorskip("torchjd.aggregation")


def krum_scores(stack: np.ndarray, n_byzantine: int, squared: bool = True) -> np.ndarray:
    """Brute force on the stack: sum of the K - f - 2 smallest distances to other rows."""
    count = len(stack)
    scores = []
    for i in range(count):
        distances = sorted(
            float(np.sum((stack[i] - stack[j]) ** 2)) for j in range(count) if j != i
        )
        if not squared:
            distances = sorted(np.sqrt(distances))
        scores.append(sum(distances[: count - n_byzantine - 2]))
    return np.array(scores)


@pytest.mark.parametrize("n_byzantine", [0, 1])
@pytest.mark.parametrize("n_selected", [1, 2])
@pytest.mark.parametrize("stack", parity_stacks(4), ids=lambda s: f"K{len(s)}D{s.shape[1]}")
def test_krum_matches_brute_force_and_torchjd(
    stack: torch.Tensor, n_byzantine: int, n_selected: int
) -> None:
    values = stack.numpy()
    for squared in (True, False):
        result = Krum(n_byzantine, n_selected, squared)(stack)
        scores = krum_scores(values, n_byzantine, squared)
        expected = np.argsort(scores, kind="stable")[:n_selected]
        assert result.extras["selected"] == expected.tolist()
        torch.testing.assert_close(result.direction, stack[expected].mean(dim=0), rtol=0, atol=0)
        torch.testing.assert_close(
            Krum(n_byzantine, n_selected, squared)(gram=stack @ stack.T).weights, result.weights
        )
    # TorchJD scores by plain distances: squared=False selects the same rows.
    plain = Krum(n_byzantine, n_selected, squared=False)
    theirs = aggregation.Krum(n_byzantine, n_selected)
    assert relative(plain(stack).direction, theirs(stack)) <= 2.0**-53
    single = stack.float()
    assert relative(plain(single).direction, theirs(single)) <= U32


def test_krum_scores_squared_distances_unlike_torchjd() -> None:
    """The paper's score sums squared distances; TorchJD 0.18 sums distances. On this stack
    (f = 0: two nearest neighbours) the squared score picks [1, 2], the plain one [1, 1]."""
    stack = torch.tensor(
        [[1.0, 2.0], [1.0, -4.0], [3.0, 1.0], [-2.0, 2.0], [1.0, 1.0]], dtype=torch.float64
    )
    assert int(np.argmin(krum_scores(stack.numpy(), 0))) == 0
    assert int(np.argmin(krum_scores(stack.numpy(), 0, squared=False))) == 4
    assert Krum()(stack).extras["selected"] == [0]
    assert Krum(squared=False)(stack).extras["selected"] == [4]
    torch.testing.assert_close(aggregation.Krum(0)(stack), stack[4])


@pytest.mark.parametrize(("name", "stack"), STRESS, ids=STRESS_IDS)
def test_krum_stress(name: str, stack: torch.Tensor) -> None:
    """Finite everywhere; the selected row's brute-force score is the smallest, up to the
    Gram's round-off in distances (near-duplicates score alike). Guarantee: the update
    is one of the gradients, nothing about conflicts."""
    result = Krum()(stack)
    assert torch.isfinite(result.weights).all()
    (selected,) = result.extras["selected"]
    torch.testing.assert_close(result.direction, stack[selected], rtol=0, atol=0)
    scores = krum_scores(stack.numpy(), 0)
    largest = float(stack.norm(dim=1).max()) ** 2
    assert scores[selected] <= scores.min() + 64 * np.finfo(float).eps * largest


def test_krum_needs_enough_gradients() -> None:
    with pytest.raises(ValueError, match="at least 4 usable"):
        Krum(n_byzantine=1)(random_stack(0, 3, 5))
