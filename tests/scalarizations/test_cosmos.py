"""COSMOS: its formula and gradient, TorchJD on the same inputs, seeded Dirichlet
preferences, bad settings and losses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tolerances import chain_atol, eps

from mogradient.scalarizations import COSMOS

from .helpers import F64, assert_within, budget, torchjd_scalarization

LOSS_ROWS = np.array([[2.0, 0.5, 1.2], [1.6, 0.45, 1.1], [0.9, 0.40, 0.85], [0.7, 0.39, 0.6]])


def test_cosmos_matches_its_formula_and_gradient() -> None:
    lam = 2.0
    method = COSMOS(3, lam, concentration=0.7, seed=1)
    for values in LOSS_ROWS:
        r = method.next_preference().numpy()
        assert np.all(r >= 0) and abs(r.sum() - 1) < 4 * eps(F64)
        losses = torch.tensor(values, dtype=F64, requires_grad=True)
        result = method(losses)
        (gradient,) = torch.autograd.grad(result.loss, losses)
        nr, nl = np.linalg.norm(r), np.linalg.norm(values)
        cosine = r @ values / (nr * nl)
        expected_gradient = r - lam * (r / (nr * nl) - cosine * values / nl**2)
        assert_within(result.loss, r @ values - lam * cosine, budget(lam + 1, 0))
        assert_within(gradient, expected_gradient, budget(lam / nl + 1, 0))
        assert_within(result.weights, gradient, budget(lam / nl + 1, 0))


def test_cosmos_same_as_torchjd() -> None:
    torchjd = torchjd_scalarization()
    lam = 3.0
    method = COSMOS(3, lam, seed=4)
    for values in LOSS_ROWS:
        r = method.next_preference()
        theirs = torchjd.COSMOS(lam, weights=r.clone())
        ours_in = torch.tensor(values, dtype=F64, requires_grad=True)
        theirs_in = torch.tensor(values, dtype=F64, requires_grad=True)
        our_loss, their_loss = method(ours_in).loss, theirs(theirs_in)
        # torch's cosine_similarity normalizes each vector, then takes the dot product; we
        # divide the dot product by both norms. Each path's cosine is within gamma_{K+4}
        # of the exact one (|cos| <= 1 bounds sum |r_i L_i| / (|r| |L|)), so the losses
        # differ by <= lam * 2 (K + 4) u plus an ulp of the weighted sum.
        k, u = len(values), eps(F64) / 2
        atol = lam * 2 * (k + 4) * u + chain_atol(F64, abs(float(our_loss.detach())) + 1, 2)
        assert abs(float((our_loss - their_loss).detach())) <= atol
        ours_grad = torch.autograd.grad(our_loss, ours_in)[0]
        theirs_grad = torch.autograd.grad(their_loss, theirs_in)[0]
        # The gradient's cosine part has size lam / |L| (times |r| / |r| terms <= 1): the
        # same count of roundings per path, on that scale, a few times for the chain rule.
        grad_atol = chain_atol(F64, lam / np.linalg.norm(values) + 1, 4 * (k + 4))
        torch.testing.assert_close(ours_grad, theirs_grad, rtol=0, atol=grad_atol)


def test_cosmos_preferences_are_seeded_dirichlet_draws() -> None:
    first, second = COSMOS(3, 1.0, seed=7), COSMOS(3, 1.0, seed=7)
    draws = [first.next_preference() for _ in range(5)]
    assert all(torch.equal(a, second.next_preference()) for a in draws)
    assert not torch.equal(COSMOS(3, 1.0, seed=8).next_preference(), draws[0])
    # The global RNG is neither read nor moved.
    torch.manual_seed(0)
    before = torch.get_rng_state()
    first.next_preference()
    assert torch.equal(before, torch.get_rng_state())
    # Dirichlet(a, a, a): mean 1/3, variance a * 2a / ((3a)^2 (3a + 1)) per component.
    for concentration in (1.0, 5.0):
        method = COSMOS(3, 1.0, concentration=concentration, seed=0)
        sample = torch.stack([method.next_preference() for _ in range(3000)]).numpy()
        a = concentration
        variance = 2 * a * a / ((3 * a) ** 2 * (3 * a + 1))
        # 5 standard errors of the mean; the sample variance within 15% (3000 draws).
        assert np.all(np.abs(sample.mean(0) - 1 / 3) < 5 * np.sqrt(variance / 3000))
        assert np.all(np.abs(sample.var(0) / variance - 1) < 0.15), sample.var(0) / variance


def test_bad_settings_and_losses_are_named() -> None:
    with pytest.raises(ValueError, match="lam must be finite and non-negative"):
        COSMOS(3, -1.0)
    with pytest.raises(ValueError, match="concentration"):
        COSMOS(3, 1.0, concentration=0.0)
    with pytest.raises(ValueError, match=r"call next_preference\(\) before"):
        COSMOS(3, 1.0, seed=0)(torch.tensor([1.0, 1.0, 1.0], dtype=F64))
    cosmos = COSMOS(3, 1.0, seed=0)
    cosmos.next_preference()
    with pytest.raises(ValueError, match=r"every loss is 0\.0"):
        cosmos(torch.zeros(3, dtype=F64))
