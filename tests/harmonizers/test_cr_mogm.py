"""CR-MOGM against its definition and TorchJD over consecutive calls."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mogradient.harmonizers import CRMOGM, MGDA, UPGrad

from .stacks import STACK_FAMILIES, STEPS, U, run

aggregation = pytest.importorskip("torchjd.aggregation")


def cr_mogm_reference(
    inner_weights: np.ndarray, alpha: float, initial: np.ndarray | None = None
) -> np.ndarray:
    """Zhou et al. 2022: lambda_t = alpha lambda_(t-1) + (1 - alpha) lambda^_t."""
    smoothed = inner_weights[0] if initial is None else initial
    history = []
    for weights in inner_weights:
        smoothed = alpha * smoothed + (1.0 - alpha) * weights
        history.append(smoothed)
    return np.stack(history)


def min_norm_weights(stack: torch.Tensor) -> np.ndarray:
    """MGDA's simplex QP by quadprog (its solution is accurate to ~1e-14 on these stacks)."""
    import quadprog

    jacobian = stack.numpy()
    count = len(jacobian)
    gram = jacobian @ jacobian.T
    constraints = np.hstack([np.ones((count, 1)), np.eye(count)])
    bounds = np.concatenate([[1.0], np.zeros(count)])
    return quadprog.solve_qp(gram, np.zeros(count), constraints, bounds, meq=1)[0]


class _Fixed(aggregation.Weighting):
    """A TorchJD weighting that returns given weights, one per call: isolates the average."""

    def __init__(self, sequence: list[torch.Tensor]) -> None:
        super().__init__()
        self.sequence = iter(sequence)

    def forward(self, stat: torch.Tensor, /) -> torch.Tensor:
        return next(self.sequence)


@pytest.mark.parametrize("family", STACK_FAMILIES)
@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.9])
def test_cr_mogm_matches_its_definition_and_torchjd(family: str, alpha: float) -> None:
    stacks = STACK_FAMILIES[family]
    ours = run(CRMOGM(MGDA(normalize=False), alpha=alpha), stacks)
    # Against the definition with an independent QP solver for the inner MGDA weights: the
    # average is a convex combination, so its error is at most quadprog's (~1e-14 here).
    inner = np.stack([min_norm_weights(stack) for stack in stacks])
    np.testing.assert_allclose(ours, cr_mogm_reference(inner, alpha), rtol=0, atol=1e-10)
    # Against TorchJD's average of the same inner weights: alpha a + (1 - alpha) b is
    # evaluated identically, so the two agree to the last bit or one rounding (u per step).
    ours_inner = [MGDA(normalize=False)(stack).weights for stack in stacks]
    weighting = aggregation.CRMOGMWeighting(_Fixed(ours_inner), alpha=alpha)
    theirs = np.stack([weighting(stack @ stack.T).numpy() for stack in stacks])
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=4 * STEPS * U)
    # Against TorchJD's CR-MOGM over its own MGDA (Frank-Wolfe, run to epsilon 1e-12): the
    # inner solvers differ by at most their stopping tolerance, and so do the averages.
    weighting = aggregation.CRMOGMWeighting(
        aggregation.MGDAWeighting(epsilon=1e-12, max_iters=100_000), alpha=alpha
    )
    theirs = np.stack([weighting(stack @ stack.T).numpy() for stack in stacks])
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-9)


def test_cr_mogm_initial_weights_and_alpha_schedule() -> None:
    stacks = STACK_FAMILIES["random_K3_D10"]
    initial = np.array([0.2, 0.3, 0.5])
    harmonizer = CRMOGM(alpha=0.5, initial_weights=initial.tolist())
    inner = np.stack([min_norm_weights(stack) for stack in stacks])
    expected = cr_mogm_reference(inner[:3], 0.5, initial)
    np.testing.assert_allclose(run(harmonizer, stacks[:3]), expected, atol=1e-10, rtol=0)
    harmonizer.alpha = 0.8  # the paper's schedule raises alpha as the learning rate decays
    expected = cr_mogm_reference(inner[3:], 0.8, expected[-1])
    np.testing.assert_allclose(run(harmonizer, stacks[3:]), expected, atol=1e-10, rtol=0)


def test_cr_mogm_averages_the_inner_weights_refined_on_the_stack() -> None:
    # UPGrad recomputes its weights on the stack; the average must use those.
    stacks = STACK_FAMILIES["random_K4_D25"]
    harmonizer = CRMOGM(UPGrad(), alpha=0.7)
    smoothed = None
    for stack in stacks:
        inner = UPGrad()(stack).weights
        smoothed = inner if smoothed is None else 0.7 * smoothed + 0.3 * inner
        torch.testing.assert_close(harmonizer(stack).weights, smoothed, rtol=0, atol=1e-15)
