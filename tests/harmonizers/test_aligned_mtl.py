"""Aligned-MTL: aligned gradients are orthogonal with equal norms."""

from __future__ import annotations

import pytest
import torch

from mogradient.harmonizers import AlignedMTL

from .stacks import random_jacobian


@pytest.mark.parametrize("seed", range(3))
def test_alignedmtl_aligned_gradients_are_orthogonal_with_equal_norms(seed: int) -> None:
    count = 3 + seed
    jacobian = random_jacobian(seed, count, 10, spread=1.5)
    # With a one-hot preference the weights are the balance matrix's column: stack them.
    balance = torch.stack(
        [AlignedMTL(pref_vector=torch.eye(count)[k])(jacobian).weights for k in range(count)],
        dim=1,
    )
    aligned = balance.T @ jacobian  # rows: aligned gradients
    smallest = torch.linalg.eigvalsh(jacobian @ jacobian.T).min()
    torch.testing.assert_close(
        aligned @ aligned.T,
        smallest * torch.eye(count, dtype=torch.float64),
        atol=1e-9 * float(smallest),
        rtol=0,
    )
