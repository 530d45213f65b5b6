"""ExcessMTL against its definition and TorchJD over consecutive calls."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mogradient.harmonizers import (
    CRMOGM,
    ExcessMTL,
)

from .stacks import STACK_FAMILIES, STEPS, TORCHJD_EXAMPLE, U, run

aggregation = pytest.importorskip("torchjd.aggregation")


def excess_mtl_reference(
    stacks: list[torch.Tensor], step_size: float, warmup: int, guard: float = 0.0
) -> np.ndarray:
    """ExcessMTL (He et al. 2024, the authors' code) with a warm-up baseline; ``guard`` is
    TorchJD's 1e-7 under the square root and on the baseline."""
    count, dim = stacks[0].shape
    squares = np.zeros((count, dim))
    warm = np.zeros(count)
    weights = np.full(count, 1.0 / count)
    baseline = None
    history = []
    for step, stack in enumerate(stacks, start=1):
        jacobian = stack.numpy()
        squares += jacobian**2
        scale = np.sqrt(squares + guard)
        terms = np.divide(jacobian**2, scale, out=np.zeros_like(scale), where=scale > 0)
        excess = terms.sum(axis=1)
        if step <= warmup:
            warm += excess
            history.append(weights)
            continue
        if baseline is None:
            baseline = warm / warmup
        logits = np.log(weights) + step_size * excess / (baseline + guard)
        weights = np.exp(logits - logits.max())
        weights = weights / weights.sum()
        history.append(weights)
    return np.stack(history)


@pytest.mark.parametrize("family", STACK_FAMILIES)
@pytest.mark.parametrize(("step_size", "warmup"), [(1.0, 1), (0.5, 2)])
def test_excess_mtl_matches_its_definition_and_torchjd(
    family: str, step_size: float, warmup: int
) -> None:
    stacks = STACK_FAMILIES[family]
    ours = run(ExcessMTL(step_size=step_size, warmup_steps=warmup), stacks)
    exact = excess_mtl_reference(stacks, step_size, warmup)
    guarded = excess_mtl_reference(stacks, step_size, warmup, guard=1e-7)
    weighting = aggregation.ExcessMTLWeighting(robust_step_size=step_size, n_warmup_steps=warmup)
    theirs = np.stack([weighting(stack).numpy() for stack in stacks])
    # A step adds eta r_k to the log-weights; r_k = E_k / b_k is two D-term sums of
    # non-negative terms (relative error D u each) and a division: eta r (2 D + 4) u.
    # Softmax is 1-Lipschitz in max-norm of the logits onto weights <= 1; T steps add up.
    dim = stacks[0].shape[1]
    ratio = float(np.abs(np.log(exact[1:] / exact[:-1])).max()) + 1.0
    tolerance = STEPS * 2 * (2 * dim + 4) * U * ratio * (1.0 + step_size) * 4
    assert np.abs(ours - exact).max() <= tolerance
    assert np.abs(theirs - guarded).max() <= tolerance
    assert (np.abs(ours - theirs) <= np.abs(exact - guarded) + 2 * tolerance).all()


def test_excess_mtl_is_invariant_to_each_objectives_scale() -> None:
    stacks = STACK_FAMILIES["random_K4_D25"]
    scales = torch.tensor([[1e-6], [1.0], [1e3], [1e8]], dtype=torch.float64)
    base = run(ExcessMTL(), stacks)
    torch.testing.assert_close(
        run(ExcessMTL(), [stack * scales for stack in stacks]), base, rtol=1e-12, atol=0
    )


def test_torchjd_default_excess_mtl_saturates_at_large_scale() -> None:
    # TorchJD's default n_warmup_steps=0 steps with the raw estimate (units of |g|) first:
    # at |g| ~ 1e3 one objective takes all the weight, for good. Ours stays scale-free.
    stacks = [stack * 1e3 for stack in STACK_FAMILIES["random_K3_D10"]]
    weighting = aggregation.ExcessMTLWeighting()
    theirs = np.stack([weighting(stack).numpy() for stack in stacks])
    assert (theirs.max(axis=1) > 1 - 1e-12).all()
    ours = run(ExcessMTL(), stacks)
    assert ours.max() < 0.9


def test_excess_mtl_needs_the_stack() -> None:
    with pytest.raises(ValueError, match="needs the gradient stack"):
        ExcessMTL()(gram=TORCHJD_EXAMPLE @ TORCHJD_EXAMPLE.T)
    with pytest.raises(ValueError, match="reads the gradient stack"):
        CRMOGM(ExcessMTL())(TORCHJD_EXAMPLE)
