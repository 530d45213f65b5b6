"""A Gram matrix passed in is checked once, the same way, by every method that takes one.

Round-off tolerances come from the Gram's dtype, with float32 as the floor (a float64
Gram is often summed from float32 products): a Gram computed in float32 from real
gradients passes; a matrix that is not a Gram (NaN between usable objectives,
asymmetric, |G_ij| > sqrt(G_ii G_jj), indefinite, a negative squared norm) is refused
with one message that says what is wrong and how to fix it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mogradient import HARMONIZERS, Amortizer, make_harmonizer
from mogradient._gram import gram_tolerance
from mogradient.qp import solve_cone_qp, solve_simplex_qp

NAN, INF = math.nan, math.inf
SEEDED = ("grad_vac", "pcgrad", "rlw", "grad_drop")
# Methods that accept gram= at all (the others need the stack and say so:
# tests/harmonizers/test_contract.py).
GRAM_METHODS = sorted(name for name, cls in HARMONIZERS.items() if not cls.needs_stack)
# Krum and TrimmedMean need at least 3 usable gradients; a dropped one leaves 2 here.
AT_LEAST_THREE = ("krum", "trimmed_mean")
TOLERANCE = gram_tolerance(torch.float32)
BAD_GRAMS = {
    "nan_off_diagonal": ([[1.0, NAN, 0.0], [NAN, 1.0, 0.0], [0.0, 0.0, 1.0]], "NaN or Inf"),
    "inf_off_diagonal": ([[1.0, INF], [INF, 1.0]], "NaN or Inf"),
    "asymmetric": ([[1.0, 0.5], [0.2, 1.0]], "not symmetric"),
    "beyond_cauchy_schwarz": ([[1.0, 2.0], [2.0, 1.0]], "Cauchy-Schwarz"),
    "indefinite": (
        [[1.0, 0.9, -0.9], [0.9, 1.0, 0.9], [-0.9, 0.9, 1.0]],
        "not positive semidefinite",
    ),
    "negative_squared_norm": ([[-1.0, 0.0], [0.0, 1.0]], "negative"),
    "products_of_a_zero_gradient": ([[0.0, 1.0], [1.0, 1.0]], "Cauchy-Schwarz"),
    "not_square": ([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], "square"),
}
FIX = "Pass the stack itself, or compute the Gram with mogradient.qp.gram_matrix(J)."


def build(name: str) -> object:
    return make_harmonizer(name, seed=0) if name in SEEDED else make_harmonizer(name)


def refusal(call: object) -> str:
    with pytest.raises(ValueError) as error:
        call()
    return str(error.value)


@pytest.mark.parametrize("case", sorted(BAD_GRAMS))
def test_every_method_refuses_a_matrix_that_is_not_a_gram_with_one_message(case: str) -> None:
    values, problem = BAD_GRAMS[case]
    gram = torch.tensor(values, dtype=torch.float64)
    messages = {refusal(lambda name=name: build(name)(gram=gram)) for name in GRAM_METHODS}
    messages.add(refusal(lambda: Amortizer(make_harmonizer("mgda"), period=2).full_step(gram=gram)))
    messages.add(refusal(lambda: solve_simplex_qp(gram.numpy())))
    messages.add(refusal(lambda: solve_cone_qp(gram.numpy(), np.ones(gram.shape[0]))))
    assert len(messages) == 1, messages
    message = messages.pop()
    assert message.startswith("invalid Gram matrix: ") and problem in message
    assert message.endswith(FIX)


@pytest.mark.parametrize("name", [name for name in GRAM_METHODS if name not in AT_LEAST_THREE])
def test_a_non_finite_gradient_is_dropped_not_refused(name: str) -> None:
    """A NaN in gradient 1 makes its squared norm and its products NaN: that objective is
    dropped, as it is from a stack."""
    gram = torch.tensor([[2.0, NAN, 0.5], [NAN, NAN, NAN], [0.5, NAN, 1.0]], dtype=torch.float64)
    result = build(name)(gram=gram)
    assert result.dropped == (1,)
    assert torch.isfinite(result.weights).all() and result.weights[1] == 0


def float32_gram_with_round_off() -> torch.Tensor:
    """J @ J.T in float32 of a rank-2 stack of 5 rows, 2e5 long: round-off makes it
    indefinite and slightly asymmetric, as Grams of real gradients are."""
    generator = torch.Generator().manual_seed(0)
    mixing = torch.randn(5, 2, generator=generator)
    stack = mixing @ torch.randn(2, 200_000, generator=generator)
    return stack @ stack.T


@pytest.mark.parametrize("name", GRAM_METHODS)
def test_a_float32_gram_of_real_gradients_passes(name: str) -> None:
    gram = float32_gram_with_round_off()
    norms = gram.double().diagonal().sqrt()
    cosines = gram.double() / torch.outer(norms, norms)
    assert torch.linalg.eigvalsh(0.5 * (cosines + cosines.T)).min() < 0, "no round-off to accept"
    for passed in (gram, gram.double()):
        result = build(name)(gram=passed)
        assert result.dropped == () and torch.isfinite(result.weights).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_asymmetry_is_judged_against_round_off_of_the_dtype(dtype: torch.dtype) -> None:
    base = torch.tensor([[4.0, 1.0], [1.0, 1.0]], dtype=dtype)  # sqrt(G_00 G_11) = 2
    for factor, accepted in ((0.5, True), (2.0, False)):
        gram = base.clone()
        gram[0, 1] += factor * TOLERANCE * 2.0
        if accepted:
            make_harmonizer("mgda")(gram=gram)
        else:
            assert "not symmetric" in refusal(lambda gram=gram: make_harmonizer("mgda")(gram=gram))


def test_negative_eigenvalues_are_judged_against_round_off() -> None:
    """Three cosines all -1/2 - y: eigenvalue -2y against (K - 1) tolerance = 2 TOLERANCE."""
    for excess, accepted in ((0.5, True), (2.0, False)):
        value = -0.5 - excess * TOLERANCE
        gram = torch.full((3, 3), value, dtype=torch.float64).fill_diagonal_(1.0)
        if accepted:
            assert make_harmonizer("upgrad")(gram=gram).dropped == ()
        else:
            message = refusal(lambda gram=gram: make_harmonizer("upgrad")(gram=gram))
            assert "not positive semidefinite" in message
