"""SDMGrad against its definition and TorchJD over consecutive calls."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mogradient.harmonizers import (
    SDMGrad,
)

from .stacks import STACK_FAMILIES, U, run, simplex_projection

aggregation = pytest.importorskip("torchjd.aggregation")


def sdmgrad_reference(
    stacks: list[torch.Tensor],
    lr: float = 10.0,
    momentum: float = 0.5,
    n_iter: int = 20,
    lambda_: float = 0.3,
    guard: float = 0.0,
    perturbation: int | None = None,
) -> np.ndarray:
    """SDMGrad (Xiao et al. 2023, the authors' code): the w-loop with one sample.

    ``guard`` is TorchJD's 1e-8.

    ``perturbation`` seeds a round-off sized relative change of the normalized Gram.
    """
    rng = None if perturbation is None else np.random.default_rng(perturbation)
    count = stacks[0].shape[0]
    target = np.full(count, 1.0 / count)
    w = np.full(count, 1.0 / count)
    history = []
    for stack in stacks:
        jacobian = stack.numpy()
        gram = jacobian @ jacobian.T
        scale = np.sqrt(np.diag(gram)).mean()
        normalized = gram / (scale**2 + guard)
        if rng is not None:
            noise = rng.uniform(-1.0, 1.0, gram.shape)
            normalized = normalized * (1.0 + 8 * U * (noise + noise.T) / 2)
        velocity = np.zeros(count)
        for _ in range(n_iter):
            velocity = momentum * velocity + normalized @ (w + lambda_ * target)
            w = simplex_projection(w - lr * velocity)
        history.append((w + lambda_ * target) / (1.0 + lambda_))
    return np.stack(history)


def sdmgrad_sensitivity(stacks: list[torch.Tensor], guard: float = 0.0) -> np.ndarray:
    """How far the reference's weights move when its matrix is perturbed by round-off.

    A worst-case bound is useless here: lr = 10 on a normalized Gram of norm up to K makes
    each of the 20 inner steps expand errors up to ~1 + 15 K times, and near a kink of the
    projection the iteration does amplify an ulp into 1e-8. So the tolerance is the
    problem's own sensitivity at these inputs: the largest change, over five draws, when
    every entry of the normalized Gram is multiplied by 1 + 8 u r (r uniform in [-1, 1],
    symmetric), at each step; then a factor 10 for the differences being of that kind.
    """
    base = sdmgrad_reference(stacks, guard=guard)
    spread = np.zeros(len(stacks))
    for seed in range(5):
        moved = sdmgrad_reference(stacks, guard=guard, perturbation=seed)
        spread = np.maximum(spread, np.abs(moved - base).max(axis=1))
    return 10 * spread + 8 * U


@pytest.mark.parametrize("family", STACK_FAMILIES)
def test_sdmgrad_matches_its_definition_and_torchjd(family: str) -> None:
    stacks = STACK_FAMILIES[family]
    ours = run(SDMGrad(), stacks)
    exact = sdmgrad_reference(stacks)
    guarded = sdmgrad_reference(stacks, guard=1e-8)
    weighting = aggregation.SDMGradWeighting()
    theirs = np.stack([weighting(stack @ stack.T).numpy() for stack in stacks])
    exact_tolerance = sdmgrad_sensitivity(stacks)[:, None]
    guarded_tolerance = sdmgrad_sensitivity(stacks, guard=1e-8)[:, None]
    assert (np.abs(ours - exact) <= exact_tolerance).all()
    assert (np.abs(theirs - guarded) <= guarded_tolerance).all()
    bound = np.abs(exact - guarded) + exact_tolerance + guarded_tolerance
    assert (np.abs(ours - theirs) <= bound).all()


def test_sdmgrad_weights_are_scale_invariant_where_torchjds_are_not() -> None:
    stacks = STACK_FAMILIES["random_K4_D25"]
    base = run(SDMGrad(), stacks)
    for scale in (1e-6, 1e6):
        torch.testing.assert_close(
            run(SDMGrad(), [stack * scale for stack in stacks]), base, rtol=0, atol=1e-12
        )
    # TorchJD's 1e-8 guard swamps (mean norm)^2 = 1e-12 * 25: its inner steps barely move.
    weighting = aggregation.SDMGradWeighting()
    small = [weighting((stack * 1e-6) @ (stack * 1e-6).T).numpy() for stack in stacks]
    assert np.abs(np.stack(small) - base).max() > 1e-2
