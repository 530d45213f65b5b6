"""ConFIG against its definition and TorchJD, and at float32 precision."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mogradient.harmonizers import (
    ConFIG,
)

from .stacks import (
    CASES,
    DTYPES,
    FAMILIES,
    STRESS,
    STRESS_IDS,
    float32_bound,
    parity_stacks,
    random_stack,
    relative,
    unit_condition,
    well_posed_stack,
)

aggregation = pytest.importorskip("torchjd.aggregation")


def config_reference(stack: np.ndarray, preferences: np.ndarray | None = None) -> np.ndarray:
    """ConFIG on the stack (the authors' README).

    t = pinv(unit rows) p, scaled to sum_k g_k . t/||t||.
    """
    units = stack / np.linalg.norm(stack, axis=1, keepdims=True)
    target = np.linalg.pinv(units) @ (np.ones(len(stack)) if preferences is None else preferences)
    unit_target = target / np.linalg.norm(target)
    return float(np.sum(stack @ unit_target)) * unit_target


@pytest.mark.parametrize("stack", parity_stacks(), ids=lambda s: f"K{len(s)}D{s.shape[1]}")
def test_config_matches_its_definition_and_torchjd(stack: torch.Tensor) -> None:
    result = ConFIG()(stack)
    np.testing.assert_allclose(
        result.direction.numpy(), config_reference(stack.numpy()), rtol=1e-12
    )
    cosines = (stack @ result.direction) / (stack.norm(dim=1) * result.direction.norm())
    assert cosines.min() > 0 and float(cosines.max() - cosines.min()) <= 1e-13
    assert relative(result.direction, aggregation.ConFIG()(stack)) <= 2 * stack.shape[
        1
    ] * 2.0**-53 * unit_condition(stack)
    single = stack.float()
    ours = ConFIG()(single).direction
    assert relative(ours, aggregation.ConFIG()(single)) <= float32_bound(single.double())
    torch.testing.assert_close(
        ConFIG()(gram=stack @ stack.T).weights, result.weights, rtol=1e-12, atol=0
    )


def test_config_preferences_match_definition_and_torchjd() -> None:
    stack = random_stack(7, 4, 20)
    preferences = torch.tensor([1.0, 2.0, 0.5, 1.0], dtype=torch.float64)
    result = ConFIG(pref_vector=preferences)(stack)
    reference = config_reference(stack.numpy(), preferences.numpy())
    np.testing.assert_allclose(result.direction.numpy(), reference, rtol=1e-12)
    theirs = aggregation.ConFIG(pref_vector=preferences)(stack)
    assert relative(result.direction, theirs) <= 1e-13


@pytest.mark.parametrize(("name", "stack"), STRESS, ids=STRESS_IDS)
def test_config_stress(name: str, stack: torch.Tensor) -> None:
    """Finite everywhere, on the stack and on the Gram alone. The direction matches numpy's
    pinv on the stack to 2 D eps kappa (kappa: the unit rows' condition number, 1e7 on
    near-singular stacks, where the stack refinement is what gets there; the Gram-only
    weights are then off by ~eps / lambda_min, up to 1e-2, and are only checked finite).
    Guarantee: for linearly independent gradients u_k . t = 1 for all k, so every
    g_k . d > 0 at one common cosine; rank-deficient stacks meet it in the least-squares
    sense only: where that direction conflicts with a gradient (cosine below -1e-3, far
    beyond round-off) there is no common direction and the weights are zero."""
    result = ConFIG()(stack)
    assert torch.isfinite(result.weights).all() and torch.isfinite(result.direction).all()
    gram_only = ConFIG()(gram=stack @ stack.T).weights
    assert torch.isfinite(gram_only).all()
    reference = torch.from_numpy(config_reference(stack.numpy()))
    kappa = unit_condition(stack)
    if name.startswith("rank_deficient"):
        served = (stack @ reference) / (stack.norm(dim=1) * reference.norm())
        if served.min() < -1e-3:
            assert result.fallback == "no_common_direction" and not result.weights.any()
            return
        assert relative(result.direction, reference) <= 1e-12
        return
    bound = 2 * stack.shape[1] * 2.0**-53 * kappa
    assert relative(result.direction, reference) <= bound
    cosines = (stack @ result.direction) / (stack.norm(dim=1) * result.direction.norm())
    assert (cosines > 0).all()
    assert float(cosines.max() - cosines.min()) <= bound * float(cosines.max())
    if name.startswith("spread"):
        torch.testing.assert_close(gram_only, result.weights, rtol=1e-10, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_config_exactly_opposed_unequal_norms_has_no_common_direction(dtype: torch.dtype) -> None:
    """The issue's example: [[1, 0], [-2, 0]] gave d = [-1, 0] and kkt_residual 1."""
    stack = torch.tensor([[1.0, 0.0], [-2.0, 0.0]], dtype=dtype)
    for rows in (stack, stack.flip(0), 3.7 * stack):
        result = ConFIG()(rows)
        assert result.fallback == "no_common_direction"
        assert not result.weights.any() and not result.direction.any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", [*FAMILIES, "well_posed"])
def test_config_is_permutation_invariant_and_positively_homogeneous(
    family: str, dtype: torch.dtype
) -> None:
    """ConFIG(P J) = ConFIG(J) and ConFIG(c J) = c ConFIG(J) for c > 0 (TorchJD's ConFIG keeps
    both). Rounding c J to the dtype moves a well-posed direction by ~eps times the unit
    rows' condition number (measured: 2e-7 in float32, 2e-15 in float64); a direction
    picked by round-off, a sign flip or a spurious fallback moves it by O(1). We allow
    sqrt(eps) of the directions' own length."""
    make = FAMILIES.get(family, well_posed_stack)
    tolerance = math.sqrt(torch.finfo(dtype).eps)
    for seed in range(CASES // 2):
        stack = make(seed, dtype)
        rng = np.random.default_rng(1000 + seed)
        order = torch.from_numpy(rng.permutation(len(stack)))
        factor = float(10.0 ** rng.uniform(-2.0, 2.0))
        base = ConFIG()(stack)
        for rows, multiple in ((stack[order], 1.0), (factor * stack, factor)):
            other = ConFIG()(rows)
            assert other.fallback == base.fallback
            ours, expected = other.direction.double(), multiple * base.direction.double()
            size = max(float(ours.norm()), float(expected.norm()))
            assert float((ours - expected).norm()) <= tolerance * size
