"""The coordinate-wise methods (TrimmedMean, GradDrop): stress stacks, least-squares weights,
and the refusals of Gram-only calls and amortization."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tolerances import reduction_atol

from mogradient.amortize import Amortizer
from mogradient.harmonizers import GradDrop, RewardDropout, TrimmedMean

from .stacks import STRESS, STRESS_IDS, draws_for, graddrop_reference, random_stack


@pytest.mark.parametrize(("name", "stack"), STRESS, ids=STRESS_IDS)
def test_coordinatewise_stress(name: str, stack: torch.Tensor) -> None:
    """Finite everywhere. Guarantees: each TrimmedMean coordinate lies between the
    (b+1)-th smallest and largest values there; each GradDrop coordinate (no leak) is the
    sum of the positive values there or of the negative ones."""
    values = stack.numpy()
    trimmed = TrimmedMean(1)(stack)
    assert torch.isfinite(trimmed.direction).all() and torch.isfinite(trimmed.weights).all()
    ordered = np.sort(values, axis=0)
    direction = trimmed.direction.numpy()
    assert (ordered[1] <= direction).all() and (direction <= ordered[-2]).all()
    dropped = GradDrop(seed=0)(stack)
    assert torch.isfinite(dropped.direction).all() and torch.isfinite(dropped.weights).all()
    positive, negative = np.clip(values, 0, None).sum(axis=0), np.clip(values, None, 0).sum(axis=0)
    direction = dropped.direction.numpy()
    bound = reduction_atol(torch.float64, len(stack), float(np.abs(values).sum(axis=0).max()))
    assert np.all((np.abs(direction - positive) <= bound) | (np.abs(direction - negative) <= bound))
    reference = graddrop_reference(values, draws_for(0, stack.shape[1]))
    assert float(np.abs(direction - reference).max()) <= bound


def test_coordinatewise_weights_are_least_squares_and_flagged() -> None:
    stack = random_stack(4, 5, 20)
    for harmonizer in (TrimmedMean(1), GradDrop(seed=1)):
        result = harmonizer(stack)
        assert result.extras["weights"] == "least_squares"
        solution, *_ = np.linalg.lstsq(stack.numpy().T, result.direction.numpy(), rcond=None)
        np.testing.assert_allclose(result.weights.numpy(), solution, rtol=1e-10)
        gap = stack.numpy().T @ solution - result.direction.numpy()
        expected = np.linalg.norm(gap) / np.linalg.norm(result.direction.numpy())
        assert result.extras["weights_residual"] == pytest.approx(expected, rel=1e-8)
        assert expected > 1e-3  # the direction is not in the gradients' span


@pytest.mark.parametrize(
    "harmonizer", [TrimmedMean(1), GradDrop(seed=0)], ids=["trimmed_mean", "grad_drop"]
)
def test_coordinatewise_refuse_the_gram_and_amortization(harmonizer: object) -> None:
    stack = random_stack(5, 4, 9)
    with pytest.raises(ValueError, match="pass the K x D gradient stack"):
        harmonizer(gram=stack @ stack.T)
    with pytest.raises(ValueError, match="cached weights cannot reproduce"):
        Amortizer(harmonizer)
    with pytest.raises(ValueError, match="needs the gradient stack"):
        RewardDropout(harmonizer, probability=0.5, seed=0)(stack)
    harmonizer(stack)  # still usable on a stack after the refusals
